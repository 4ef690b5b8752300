"""Kafka users and ACLs per service, rendered into ``deploy/kafka/setup.sh`` by ``generate.py``.

Each service authenticates to the broker as itself (SASL/SCRAM-SHA-512, user = service name) and
may do exactly what the platform needs of it: write the topics it owns (``forge_kit.events.OWNERS``)
and read the topics it consumes, in its own consumer group. ``allow.everyone.if.no.acl.found`` is
off, so anything not listed is denied — a service cannot publish another's events even before the
consumer's signature check would drop them.
"""

from __future__ import annotations

from forge.events.v1 import events_pb2

from forge_kit.events import OWNERS, TOPICS

#: Consumer groups and the events each consuming service reads in them (their ``__main__`` wiring).
CONSUMES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "orchestrator": (
        (
            "orchestrator",
            (
                events_pb2.JobStateChanged.DESCRIPTOR.full_name,
                events_pb2.CheckpointPublished.DESCRIPTOR.full_name,
            ),
        ),
        # The consumer that records training runs in MLflow (``forge_orchestrator.tracking.consumer``).
        (
            "orchestrator-tracking",
            (
                events_pb2.JobStateChanged.DESCRIPTOR.full_name,
                events_pb2.TrainingMetrics.DESCRIPTOR.full_name,
                events_pb2.CheckpointPublished.DESCRIPTOR.full_name,
                events_pb2.EvalCompleted.DESCRIPTOR.full_name,
            ),
        ),
    ),
    "inference_gateway": (("inference_gateway", (events_pb2.ModelPromoted.DESCRIPTOR.full_name,)),),
    "retriever": (("retriever", (events_pb2.DocumentChanged.DESCRIPTOR.full_name,)),),
}


def acls(services: list[str]) -> list[tuple[str, str]]:
    """(user, kafka-acls.sh arguments) for every grant, in a stable order."""
    grants: list[tuple[str, str]] = []
    for service in services:
        for event, owner in sorted(OWNERS.items()):
            if owner == service:
                grants.append((service, f"--operation Write --operation Describe --topic {TOPICS[event]}"))
        groups = CONSUMES.get(service, ())
        read = sorted({TOPICS[event] for _, events in groups for event in events})
        for topic in read:
            grants.append((service, f"--operation Read --operation Describe --topic {topic}"))
        for group, _ in groups:
            grants.append((service, f"--operation Read --group {group}"))
    return grants


def setup_script(services: list[str], header: str) -> str:
    """A bash script that creates every topic, one SCRAM user per service (its password from
    ``$FORGE_KAFKA_PASSWORD_<SERVICE>``) and the ACLs. Run against a listener where the caller
    is a super user: ``setup.sh BOOTSTRAP [--command-config FILE]``. Safe to run again."""
    lines = [
        "#!/usr/bin/env bash",
        header.rstrip().replace("\n", "\n"),
        "# Topics, SCRAM users and ACLs of every Forge service (deploy/kafka_acls.py).",
        "# Usage: setup.sh BOOTSTRAP [--command-config FILE]; passwords from $FORGE_KAFKA_PASSWORD_<SERVICE>.",
        "set -euo pipefail",
        'bootstrap="$1"; shift',
        'bin="${KAFKA_BIN:-/opt/kafka/bin}"',
        'topic() { "$bin/kafka-topics.sh" --bootstrap-server "$bootstrap" "$@" ; }',
        'user() { "$bin/kafka-configs.sh" --bootstrap-server "$bootstrap" "${@:3}" --alter --entity-type users '
        '--entity-name "$1" --add-config "SCRAM-SHA-512=[password=$2]" ; }',
        'acl() { "$bin/kafka-acls.sh" --bootstrap-server "$bootstrap" --add --allow-principal "User:$1" "${@:2}" ; }',
        'extra=("$@")',
    ]
    for name in sorted(set(TOPICS.values())):
        lines.append(
            f'topic "${{extra[@]}}" --create --if-not-exists --partitions 3 --replication-factor 1 --topic {name}'
        )
    for service in services:
        lines.append(f'user {service} "${{FORGE_KAFKA_PASSWORD_{service.upper()}:?}}" "${{extra[@]}}"')
    for service, args in acls(services):
        lines.append(f'acl {service} {args} "${{extra[@]}}"')
    return "\n".join(lines) + "\n"


def start_script(header: str, admin_listener: str) -> str:
    """The Compose broker's command: start Kafka, run ``setup.sh`` over the loopback listener,
    then mark the container healthy (``/tmp/forge-kafka-ready``)."""
    return (
        "\n".join(
            [
                "#!/usr/bin/env bash",
                header.rstrip(),
                "set -euo pipefail",
                "rm -f /tmp/forge-kafka-ready",
                "/etc/kafka/docker/run &",
                "broker=$!",
                f"until /opt/kafka/bin/kafka-broker-api-versions.sh --bootstrap-server {admin_listener} >/dev/null 2>&1; do",
                '  kill -0 "$broker" || exit 1',
                "  sleep 1",
                "done",
                f"bash /opt/forge/kafka-setup.sh {admin_listener}",
                "touch /tmp/forge-kafka-ready",
                'wait "$broker"',
            ]
        )
        + "\n"
    )
