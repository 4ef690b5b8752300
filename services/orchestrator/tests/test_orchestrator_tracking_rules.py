"""The tracking code's rules without a server: filters, keys, params from jobs and manifests, the
loss curve; and two callers racing to make one job's run end up with the same run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
from pathlib import Path

import pytest

from forge_kit.testing import MlflowServer
from forge_orchestrator.tracking.consumer import (
    JobInfo,
    RunRecorder,
    job_params,
    job_tags,
    manifest_params,
    overrides_of,
    render_loss_curve,
)
from forge_orchestrator.tracking.tracker import (
    MLFLOW_PARENT_RUN_ID,
    MLFLOW_RUN_NAME,
    RunFilter,
    TrackedRun,
    Tracker,
    differing_params,
    filter_value,
    valid_key,
)


def test_the_orchestrator_starts_without_the_mlflow_or_openai_packages() -> None:
    """An orchestrator with no tracking server never imports MLflow, and none imports the openai
    SDK before a synthetic run calls a model: seconds of CPU off every start."""
    code = "import sys, forge_orchestrator.__main__\nprint(sorted(m for m in ('mlflow', 'openai') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_tag_names_spelled_here_are_mlflows() -> None:
    from mlflow.utils import mlflow_tags

    assert (MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME) == (
        mlflow_tags.MLFLOW_PARENT_RUN_ID,
        mlflow_tags.MLFLOW_RUN_NAME,
    )


def test_filter_quotes_every_value_and_refuses_ones_that_could_close_the_quote() -> None:
    text = RunFilter(recipe="tiny_pretrain", sweep_id="s-1", tags={"forge.trial": "2"}).to_mlflow()
    assert text == (
        "tags.`forge.recipe` = 'tiny_pretrain' and tags.`forge.sweep_id` = 's-1' and tags.`forge.trial` = '2'"
    )
    assert RunFilter().to_mlflow() == ""
    for bad in ("a' or '1'='1", "x\\", "", "a\nb", "x" * 251):
        with pytest.raises(ValueError, match="not allowed in a run filter"):
            filter_value(bad)
    with pytest.raises(ValueError, match="tag name"):
        RunFilter(tags={"a`b": "x"}).to_mlflow()


def test_keys_mlflow_would_refuse_are_recognised() -> None:
    assert (
        valid_key("loss")
        and valid_key("eval/tinyshakespeare_ppl/perplexity")
        and valid_key("override.optim.lr")
    )
    for bad in ("", "../x", "/abs", "a\x00b", "ünicode", "k" * 251):
        assert not valid_key(bad), bad


def test_params_and_tags_come_from_the_job() -> None:
    command = [
        "python",
        "-m",
        "forge_training.run",
        "--recipe",
        "tiny",
        "--set",
        "optim.lr=3e-4",
    ]
    command += ["--set", "seed=1", "--set"]  # a trailing --set without a value is ignored
    assert overrides_of(command) == ["optim.lr=3e-4", "seed=1"]
    job = JobInfo(
        "j-1",
        "team-a",
        "train",
        {"recipe": "tiny", "workflow_id": "wf", "sweep_id": "s", "trial": "4", "other": "x"},
        command,
    )
    assert job_tags(job) == {
        "forge.team": "team-a",
        "forge.recipe": "tiny",
        "forge.workflow_id": "wf",
        "forge.sweep_id": "s",
        "forge.trial": "4",
    }
    assert job_params(job, "abc123") == {
        "recipe": "tiny",
        "overrides": "optim.lr=3e-4 seed=1",
        "override.optim.lr": "3e-4",
        "override.seed": "1",
        "code_version": "abc123",
    }


def test_manifest_params_take_config_hash_data_hash_and_seed() -> None:
    manifest = {"meta": {"recipe_hash": "h1", "data_hash": "d1", "config": {"seed": 5, "lr": 1}}}
    assert manifest_params(manifest) == {"config_hash": "h1", "data_hash": "d1", "seed": "5"}
    assert manifest_params({"meta": "not a dict"}) == {} == manifest_params({})


def test_loss_curve_is_a_png_and_nothing_is_drawn_without_points(tmp_path: Path) -> None:
    path = tmp_path / "curve.png"
    assert render_loss_curve(
        {"loss": [(1, 3.0), (2, 2.5)], "val_loss": []}, path, "job x", [(1, 1e-3), (2, 5e-4)]
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
    assert not render_loss_curve({"loss": []}, tmp_path / "none.png", "job y")
    assert not (tmp_path / "none.png").exists()


def test_differing_params_count_a_missing_param_as_different() -> None:
    def run(params: dict[str, str]) -> TrackedRun:
        return TrackedRun("r", "n", "FINISHED", 0, {}, params, {}, "u")

    runs = [run({"lr": "1", "seed": "0"}), run({"lr": "2", "seed": "0"}), run({"lr": "1"})]
    assert differing_params(runs) == {"lr": ["1", "2", "1"], "seed": ["0", "0", ""]}


def test_tracker_refuses_a_uri_that_is_not_an_http_server() -> None:
    for bad in ("file:///tmp/mlruns", "sqlite:///x.db", "databricks"):
        with pytest.raises(ValueError, match="http"):
            Tracker(bad)


@pytest.mark.integration
def test_two_callers_racing_for_one_jobs_run_end_with_the_same_run(mlflow_server: MlflowServer) -> None:
    tracker = Tracker(mlflow_server.url)
    job_id = "race-job-1"

    def ensure(index: int) -> str:
        return Tracker(mlflow_server.url).ensure_job_run(
            job_id, tags={"forge.recipe": "tiny"}, params={"caller": str(index)}
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(ensure, range(4)))
    assert len(set(ids)) == 1
    assert [r.run_id for r in tracker.find_runs(RunFilter(job_id=job_id))] == [ids[0]]


class Jobs:
    """A job directory over a dict (the scheduler's answers, as :class:`SchedulerJobs` gives them)."""

    def __init__(self, *jobs: JobInfo) -> None:
        self.jobs = {j.job_id: j for j in jobs}

    async def get_job(self, job_id: str) -> JobInfo | None:
        return self.jobs.get(job_id)


def test_a_resumed_trial_job_continues_its_first_jobs_run_only_within_its_own_sweep_and_trial() -> None:
    labels = {"recipe": "tiny", "sweep_id": "sw-1", "trial": "2"}
    first = JobInfo("job-a", "research", "t2", dict(labels))
    resumed = JobInfo("job-b", "research", "t2", {**labels, "resumes_job": "job-a"})
    other_trial = JobInfo("job-c", "research", "t3", {**labels, "trial": "3", "resumes_job": "job-a"})
    other_team = JobInfo("job-d", "intruders", "t2", {**labels, "resumes_job": "job-a"})
    no_sweep = JobInfo("job-e", "research", "x", {"recipe": "tiny", "resumes_job": "job-a"})
    recorder = RunRecorder(Tracker("http://127.0.0.1:1"), Jobs(first, resumed, other_trial, other_team))
    found = {
        j.job_id: asyncio.run(recorder._resumed_job(j)) for j in (resumed, other_trial, other_team, no_sweep)
    }
    assert found == {"job-b": "job-a", "job-c": "", "job-d": "", "job-e": ""}
    unknown = JobInfo("job-f", "research", "t2", {**labels, "resumes_job": "job-gone"})
    assert asyncio.run(recorder._resumed_job(unknown)) == ""
