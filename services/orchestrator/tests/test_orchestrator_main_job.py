"""The ``rlhf`` main-job step without the platform: its input passes the API's own checks, its
report reads the workflow's result as GetWorkflow returns it, and against a real orchestrator API
(Temporal dev server, no RLHF worker polling) an overrun round is cancelled with a clear error.
The round itself runs in ``test_orchestrator_rlhf.py`` with the same sizes (:data:`RLHF_SIZES`)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2
from temporalio.client import Client

from forge_kit.testing import TemporalDevServer
from forge_kit.testing.grpcserver import grpc_test_server
from forge_orchestrator.api import OrchestratorApi
from forge_orchestrator.main_job import rlhf as main_job
from forge_orchestrator.main_job.rlhf import RlhfStepError, rlhf, rlhf_input, round_report
from forge_orchestrator.rlhf.model import DriftPoint, RlhfInput, RlhfResult, RoundRecord
from forge_orchestrator.rlhf.worker import validate_rlhf
from forge_orchestrator.service import OrchestratorService, parse_input

TOKEN = "main-job-test-token"
CHECKPOINT = "/var/runs/job-1/hf"
DONE = {"train": {"checkpoint_uri": CHECKPOINT}, "chat": {"trained_model": "main-job-smoke:3"}}


def context(tmp_path: Path, results: dict[str, Any], target: str = "127.0.0.1:1") -> Any:
    endpoint = SimpleNamespace(grpc_target=target, http_url="http://127.0.0.1:1", token=TOKEN)
    return SimpleNamespace(
        results=results,
        object_store_url=str(tmp_path / "objects"),
        root=tmp_path,
        endpoint=lambda name: endpoint,
    )


def as_get_workflow_returns_it(value: object) -> dict[str, Any]:
    """JSON → Struct → JSON, as a workflow result travels to GetWorkflow (numbers become floats)."""
    return json_format.MessageToDict(json_format.ParseDict(value, struct_pb2.Struct()))


def test_input_is_the_train_checkpoint_with_small_sizes_and_passes_the_api_checks(tmp_path: Path) -> None:
    data = rlhf_input(context(tmp_path, DONE))
    params = parse_input(RlhfInput, as_get_workflow_returns_it(data))
    validate_rlhf(params)
    # Online: the policy as the chat step serves it through the gateway is sampled.
    assert params.sample_model == "main-job-smoke:3" and params.monitor_interval == 2
    assert params.prompt_dataset == "preferences/hh-rlhf/helpful-base/test.jsonl.gz"
    assert params.policy_uri == CHECKPOINT and params.work_uri == f"{tmp_path / 'objects'}/rlhf"
    assert (params.team, params.gpu_type, params.max_rounds) == ("main-job", "SIM", 1)
    assert "max_steps=40" in params.reward_overrides and "max_steps=10" in params.dpo_overrides
    assert params.promote and params.promote_suite == "tinyshakespeare_ppl"


def test_without_the_train_step_the_step_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(
        RlhfStepError, match=r"ctx.results\['train'\] has no checkpoint_uri \(steps done: smoke\)"
    ):
        rlhf_input(context(tmp_path, {"smoke": {"ok": True}}))
    with pytest.raises(
        RlhfStepError, match=r"ctx.results\['chat'\] has no trained_model \(steps done: train\)"
    ):
        rlhf_input(context(tmp_path, {"train": {"checkpoint_uri": CHECKPOINT}}))


def _round(**values: Any) -> RoundRecord:
    base: dict[str, Any] = {
        "round": 1,
        "snapshot_id": "snap-1",
        "train_pairs": 94,
        "test_pairs": 50,
        "excluded_raters": {"mainjob": "too fast (median 0.0s per item)"},
        "reward_model": "rm-rlhf:main-job-rlhf.r1",
        "rm_accuracy": 0.88,
        "rm_ci95_low": 0.7619,
        "rm_ci95_high": 0.9438,
        "rm_n": 50,
    }
    return RoundRecord(**{**base, **values})


def test_report_of_a_promoted_round_has_the_reward_model_and_drift_figures() -> None:
    drift = [
        DriftPoint("/ref", 0.0, 0.0, -0.1, 0.5),
        DriftPoint("/dpo", 0.36, 0.6, 0.4, 0.62),
    ]
    record = _round(
        status="completed",
        decision="promoted",
        drift=drift,
        policy_uri="/dpo",
        step="x",
        batch="main-job-rlhf-1/r1",
        prompts={"dataset": 16, "production": 0},
        queued=15,
        new_pairs=41,
        training_monitor=[
            {"step": 0, "kl": 0.0, "proxy_reward": -0.1, "heldout_agreement": 0.5},
            {"step": 2, "kl": 0.05, "proxy_reward": 0.1, "heldout_agreement": 0.6},
        ],
    )
    result = as_get_workflow_returns_it(dataclasses.asdict(RlhfResult(rounds=[record], policy_uri="/dpo")))
    report = round_report(result)
    assert report["outcome"] == "eval-and-promote: promoted" and report["promoted"] is True
    assert (report["rm_accuracy"], report["rm_ci95"], report["rm_n"]) == (0.88, [0.7619, 0.9438], 50)
    assert (report["kl"], report["sqrt_kl"], report["heldout_agreement"]) == (0.36, 0.6, 0.62)
    assert report["reference_proxy_reward"] == -0.1 and report["proxy_reward"] == 0.4
    assert report["pairs"] == {"train": 94, "heldout": 50} and "mainjob" in report["excluded_raters"]
    assert report["policy_samples"] == {
        "batch": "main-job-rlhf-1/r1",
        "prompts": {"dataset": 16, "production": 0},
        "comparisons_queued": 15,
        "accepted_preferences": 41,
    }
    assert report["dpo_monitor"] == {
        "checks": 2,
        "last": {"step": 2.0, "kl": 0.05, "proxy_reward": 0.1, "heldout_agreement": 0.6},
        "early_stop": "",
    }


def test_report_of_a_stalled_round_says_stalled_and_why() -> None:
    reason = "raters did not answer in time: 3 accepted preference(s) of 24 needed ..."
    record = _round(status="stalled", reason=reason, queued=15, new_pairs=3, snapshot_id="")
    report = round_report(as_get_workflow_returns_it(dataclasses.asdict(RlhfResult(rounds=[record]))))
    assert report["outcome"] == f"stalled: {reason}" and report["promoted"] is False
    assert report["policy_samples"]["accepted_preferences"] == 3


def test_the_rule_raters_prefer_more_full_stops_then_the_shorter_reply() -> None:
    from forge.common.v1 import common_pb2

    from forge_orchestrator.main_job.raters import rule_choice

    assert rule_choice("Yes. Sure.", "Yes sure.") == common_pb2.PREFERENCE_CHOICE_A
    assert rule_choice("a long reply.", "short.") == common_pb2.PREFERENCE_CHOICE_B
    assert rule_choice("same", "same") == common_pb2.PREFERENCE_CHOICE_TIE


def test_report_of_a_refused_reward_model_says_refused_and_why() -> None:
    reason = (
        "reward model rm-rlhf:x.r1: held-out pairwise accuracy 0.520 [0.380, 0.657] ... does not beat 50%"
    )
    record = _round(status="rejected", reason=reason, rm_accuracy=0.52, rm_ci95_low=0.38, rm_ci95_high=0.657)
    report = round_report(as_get_workflow_returns_it(dataclasses.asdict(RlhfResult(rounds=[record]))))
    assert report["outcome"] == f"refused: {reason}" and report["promoted"] is False
    assert report["kl"] is None and report["rm_ci95"] == [0.38, 0.657]


def test_a_result_without_rounds_is_an_error() -> None:
    with pytest.raises(RlhfStepError, match="ran no round"):
        round_report({"rounds": [], "ended": "cancelled"})


@pytest.fixture
async def orchestrator(temporal_server: TemporalDevServer) -> AsyncIterator[tuple[Client, str]]:
    """The real OrchestratorService behind its gRPC API; no worker polls the RLHF queue."""
    client = await Client.connect(temporal_server.target)
    api = OrchestratorApi(OrchestratorService(client, f"main-job-test-{uuid.uuid4().hex[:8]}"))
    async with grpc_test_server(
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server,
        api,
        orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name,
        token=TOKEN,
        service="orchestrator",
        default_deadline_s=10,
    ) as server:
        yield client, f"127.0.0.1:{server.port}"


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_round_that_overruns_is_cancelled_and_the_step_says_where_it_was(
    orchestrator: tuple[Client, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, target = orchestrator
    monkeypatch.setattr(main_job, "RLHF_WAIT_S", 2.0)
    ctx = context(tmp_path, DONE, target)
    with pytest.raises(RlhfStepError, match=r"still running after 2s \(at: unknown\); cancelled") as caught:
        await rlhf(ctx)
    workflow_id = str(caught.value).split()[2]
    handle = client.get_workflow_handle(workflow_id)
    described = await handle.describe()
    assert described.workflow_type == "rlhf" and described.task_queue.endswith("-rlhf")
    history = await handle.fetch_history()
    assert any(e.HasField("workflow_execution_cancel_requested_event_attributes") for e in history.events)
    await handle.terminate("test done")


def test_report_of_a_round_says_what_the_guarded_canary_decided() -> None:
    why = "canary rolled back (analysis): too little traffic: 0 requests per arm, 15 needed"
    record = _round(status="completed", decision="rolled_back", reason=why)
    report = round_report(as_get_workflow_returns_it(dataclasses.asdict(RlhfResult(rounds=[record]))))
    assert report["outcome"] == f"eval-and-promote: rolled_back ({why})" and report["promoted"] is False
    record = _round(status="completed", decision="promoted", reason="canary promote after 8.0s: no worse")
    report = round_report(as_get_workflow_returns_it(dataclasses.asdict(RlhfResult(rounds=[record]))))
    assert report["outcome"] == "eval-and-promote: promoted (canary promote after 8.0s: no worse)"
