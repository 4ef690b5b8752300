"""``forge runs list/compare`` and the MLflow UI over a sweep's runs, against a real MLflow server.

A sweep parent with three trial runs is recorded through :class:`Tracker` (as the sweep workflow
and the tracking consumer do); the CLI filters and compares them, and a headless Chromium
(Playwright, Debian's ``chromium``) opens the MLflow UI, expands the sweep and screenshots it.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_kit.testing import MlflowServer
from forge_orchestrator.tracking.cli import app
from forge_orchestrator.tracking.tracker import RunFilter, Tracker

pytestmark = [pytest.mark.integration]


@pytest.fixture(autouse=True)
def _cli_settings_stay_in_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI makes MLflow's client give up fast by setting its variables in the process's
    environment (its own process, when a person runs it). Here it runs in the test process: set
    them through monkeypatch so they are taken back afterwards, and service processes that later
    tests start do not inherit a client that stops retrying."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Sweep:
    sweep_id: str
    parent: str
    trials: list[str]
    names: list[str]


@pytest.fixture
def sweep(mlflow_server: MlflowServer) -> Sweep:
    tracker = Tracker(mlflow_server.url)
    sweep_id = f"sw{uuid.uuid4().hex[:8]}"
    parent = tracker.ensure_sweep_run(sweep_id, f"sweep-{sweep_id}", {"space": "lr x warmup"})
    trials, names = [], [f"sweep-{sweep_id}"]
    for trial, (lr, loss) in enumerate([("0.001", 2.9), ("0.003", 2.4), ("0.01", 3.5)]):
        name = f"{sweep_id}-trial-{trial}"
        run_id = tracker.ensure_job_run(
            f"job-{sweep_id}-{trial}",
            tags={"forge.recipe": "tiny_pretrain", "forge.sweep_id": sweep_id, "forge.trial": str(trial)},
            params={"recipe": "tiny_pretrain", "override.optim.lr": lr, "seed": "0"},
            parent_run_id=parent,
            name=name,
        )
        for step, value in ((10, loss + 1.0), (20, loss)):
            tracker.log_metrics(run_id, step, {"loss": value, "tokens_per_s": 4000.0})
        tracker.set_terminated(run_id, "FINISHED")
        trials.append(run_id)
        names.append(name)
    return Sweep(sweep_id, parent, trials, names)


def invoke(mlflow_server: MlflowServer, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--mlflow-uri", mlflow_server.url])
    return result.exit_code, result.output


def test_list_filters_by_sweep_tag_and_recipe(mlflow_server: MlflowServer, sweep: Sweep) -> None:
    code, out = invoke(mlflow_server, "list", "--sweep", sweep.sweep_id, "--json")
    assert code == 0, out
    rows = json.loads(out)
    assert {r["run_id"] for r in rows} == {sweep.parent, *sweep.trials}
    trial_rows = {r["trial"]: r for r in rows if r["trial"]}
    assert trial_rows["1"]["loss"] == 2.4 and trial_rows["1"]["parent_run_id"] == sweep.parent
    assert all(r["url"].endswith(f"/runs/{r['run_id']}") for r in rows)

    code, out = invoke(mlflow_server, "list", "--sweep", sweep.sweep_id, "--tag", "forge.trial=2", "--json")
    assert code == 0, out
    assert [r["run_id"] for r in json.loads(out)] == [sweep.trials[2]]

    code, out = invoke(mlflow_server, "list", "--recipe", "no-such-recipe", "--json")
    assert (code, json.loads(out)) == (0, [])


def test_compare_shows_metrics_side_by_side_and_differing_params(
    mlflow_server: MlflowServer, sweep: Sweep
) -> None:
    code, out = invoke(mlflow_server, "compare", *sweep.trials, "--json")
    assert code == 0, out
    result = json.loads(out)
    assert result["metrics"]["loss"] == [2.9, 2.4, 3.5]
    assert result["params_differing"] == {"override.optim.lr": ["0.001", "0.003", "0.01"]}
    code, out = invoke(mlflow_server, "compare", *sweep.trials)
    assert code == 0 and "override.optim.lr" in out and "params that differ" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("list", "--tag", "novalue"), "is not key=value"),
        (("list", "--tag", "k=it's"), "not allowed in a run filter"),
        (("list", "--sweep", "a' or '1'='1"), "not allowed in a run filter"),
        (("compare", "onlyone"), "give 2 to 20 run ids"),
        (("compare", "abc", "../../etc"), "is not an MLflow run id"),
    ],
)
def test_bad_input_is_refused_naming_it(
    mlflow_server: MlflowServer, args: tuple[str, ...], message: str
) -> None:
    code, out = invoke(mlflow_server, *args)
    assert code == 2, out
    assert message in " ".join(re.sub("[\u2500-\u257f]", " ", out).split())  # without rich's box


def test_unknown_run_and_unreachable_server_are_one_line_errors(mlflow_server: MlflowServer) -> None:
    code, out = invoke(mlflow_server, "compare", "0" * 32, "1" * 32)
    assert code == 1 and "MLflow at" in out
    result = CliRunner().invoke(app, ["list", "--mlflow-uri", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and "MLflow at http://127.0.0.1:9" in result.output


@pytest.mark.asyncio
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
async def test_mlflow_ui_shows_the_sweep_parent_with_its_trials(
    mlflow_server: MlflowServer, sweep: Sweep, tmp_path: Path
) -> None:
    playwright_api = pytest.importorskip("playwright.async_api")
    tracker = Tracker(mlflow_server.url)
    assert {
        r.parent_run_id for r in tracker.find_runs(RunFilter(sweep_id=sweep.sweep_id)) if r.parent_run_id
    } == {sweep.parent}
    shot = tmp_path / "mlflow-sweep.png"
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1400, "height": 900})
        await page.goto(f"{mlflow_server.url}/#/experiments/{tracker.experiment_id()}/runs")
        parent_name = f"sweep-{sweep.sweep_id}"
        await page.get_by_text(parent_name, exact=True).wait_for(timeout=60_000)
        # Trials are nested under their parent: expand it.
        parent_row = page.get_by_role("row").filter(has_text=parent_name).first
        await parent_row.locator('[col-id="attributes.`Run Name`"] button').first.click()
        for name in sweep.names:
            await page.get_by_text(name, exact=True).first.wait_for(timeout=30_000)
        await page.screenshot(path=str(shot), full_page=True)
        text = await page.inner_text("body")
        await browser.close()
    assert shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in sweep.names:
        assert name in text


def test_workflows_show_links_the_runs_of_the_workflow(mlflow_server: MlflowServer) -> None:
    from forge_orchestrator.cli import mlflow_links

    tracker = Tracker(mlflow_server.url)
    workflow_id = f"wf-{uuid.uuid4().hex[:8]}"
    run_id = tracker.ensure_job_run(f"job-{workflow_id}", tags={"forge.workflow_id": workflow_id}, params={})
    assert mlflow_links(mlflow_server.url, workflow_id) == [tracker.run_url(run_id)]
    assert mlflow_links(mlflow_server.url, "wf-without-runs") == []
    assert mlflow_links("http://127.0.0.1:9", workflow_id) == []  # the workflow is shown without them


@dataclass
class StepContext:
    """What ``forge up`` hands a main-job step, as far as the tracking step reads it."""

    mlflow_url: str
    results: dict[str, dict[str, object]]


@pytest.mark.asyncio
async def test_main_job_tracking_step_shows_the_closed_run_of_the_train_step(
    mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forge_orchestrator.main_job import tracking as main_job_tracking
    from forge_orchestrator.tracking.consumer import render_loss_curve

    tracker = Tracker(mlflow_server.url)
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    run_id = tracker.ensure_job_run(job_id, tags={}, params={"recipe": "tiny", "seed": "0"})
    tracker.log_metrics(run_id, 10, {"loss": 3.0})
    ctx = StepContext(mlflow_server.url, {"train": {"job_id": job_id}})
    monkeypatch.setattr(main_job_tracking, "TRACKING_WAIT_S", 2.0)
    with pytest.raises(RuntimeError, match="not closed within 2s"):
        await main_job_tracking.tracking(ctx)
    tracker.set_terminated(run_id, "FINISHED")
    assert render_loss_curve({"loss": [(10, 3.0)]}, tmp_path / "loss_curve.png", job_id)
    tracker.log_artifact(run_id, tmp_path / "loss_curve.png", "plots")
    result = await main_job_tracking.tracking(ctx)
    assert result["ok"] is True and result["mlflow_url"] == tracker.run_url(run_id)
    assert result["loss_steps_logged"] == 1 and result["params"] == {"recipe": "tiny", "seed": "0"}
    assert result["artifacts"] == ["plots/loss_curve.png"]
