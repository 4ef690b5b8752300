"""A trainer agent's node label is checked before it reaches a gRPC channel as a catch-up source
(the end to end read of an agent's outbox: tests/faults/test_sweep_faults.py, broker restart)."""

from __future__ import annotations

from forge_orchestrator.agent_logs import EVENT_LOG_LABEL, event_log_target


def test_only_a_plain_host_and_port_is_taken_from_a_node_label() -> None:
    assert EVENT_LOG_LABEL == "forge.ai/event-log"  # the label forge_trainer_agent.node writes
    assert event_log_target({EVENT_LOG_LABEL: "10.0.0.7:50052"}) == "10.0.0.7:50052"
    assert event_log_target({EVENT_LOG_LABEL: "agent-1.forge.svc:50052"}) == "agent-1.forge.svc:50052"
    assert event_log_target({}) == ""
    for bad in (
        "10.0.0.7",
        "10.0.0.7:0",
        "10.0.0.7:70000",
        "unix:///tmp/sock",
        "dns:///evil:1",
        "host:50052/path",
        "-host:1",
        "h" * 300 + ":1",
    ):
        assert event_log_target({EVENT_LOG_LABEL: bad}) == "", bad
