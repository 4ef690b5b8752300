"""The synthetic-data worker: its settings, task queue and the Temporal worker that runs the
``synthetic`` workflow with its children (``training``, ``rlhf_job``) and their activities.

Like the RLHF loop it runs on a queue of its own, ``<task queue>-synthetic``, so the main worker's
registrations stay as they are; children inherit the queue, and job events reach them by
workflow id whatever their queue. It registers the promotion activities
(:class:`~forge_orchestrator.deploy.promotion.PromotionActivities`) the workflow deploys and
drains its student with; their ``deployment`` workflows run on the main queue, as every
deployment's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio.client import Client
from temporalio.worker import Interceptor, Worker

from forge_kit.settings import ForgeSettings, service_config
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.deploy.promotion import PromotionActivities
from forge_orchestrator.synthetic.activities import Endpoint, SyntheticActivities, Tracker
from forge_orchestrator.synthetic.workflow import SYNTHETIC_WORKFLOWS


class SyntheticSettings(ForgeSettings):
    """Settings of the orchestrator's synthetic-data worker (env prefix ``FORGE_SYNTHETIC_``)."""

    model_config = service_config("synthetic")

    enabled: bool = True
    """Run the synthetic-data worker in the orchestrator process; when off, StartWorkflow refuses ``synthetic``."""

    teacher_url: str = "http://127.0.0.1:8071/v1"
    """OpenAI-compatible base URL of the teacher: vLLM serving a strong model in production; by
    default the programmatic teacher (``python -m forge_training.synthetic.teacher``)."""

    teacher_token: str = ""
    """Bearer token of ``teacher_url`` (sent to that URL only)."""

    student_url: str = ""
    """OpenAI-compatible base URL the student is sampled at; empty: the inference gateway's
    (``FORGE_ORCHESTRATOR_INFERENCE_GATEWAY_URL`` or ``FORGE_RLHF_GATEWAY_URL``, ``/v1``) with the
    orchestrator's ``inference_gateway_token``."""

    student_token: str = ""
    """Bearer token of ``student_url`` (sent to that URL only)."""


def synthetic_task_queue(task_queue: str) -> str:
    return f"{task_queue}-synthetic"


def endpoints(settings: SyntheticSettings, gateway_url: str, gateway_token: str) -> tuple[Endpoint, Endpoint]:
    """The configured teacher and student endpoints (the student: the gateway by default)."""
    teacher = Endpoint(settings.teacher_url, settings.teacher_token)
    if settings.student_url:
        return teacher, Endpoint(settings.student_url, settings.student_token)
    url = f"{gateway_url.rstrip('/')}/v1" if gateway_url else ""
    return teacher, Endpoint(url, gateway_token)


def build_synthetic_worker(
    client: Client,
    task_queue: str,
    scheduler: SchedulerActivities,
    teacher: Endpoint,
    student: Endpoint,
    tracker: Tracker | None = None,
    promotions: PromotionActivities | None = None,
    *,
    guard: Interceptor | None,
) -> Worker:
    """A worker on :func:`synthetic_task_queue` (``task_queue``) for the workflow, its children and
    activities. ``promotions`` None (or without serving): the student is not deployed, it is
    sampled at ``student`` as it is."""
    synthetic = SyntheticActivities(teacher, student, tracker)
    methods: list[Callable[..., Any]] = [
        scheduler.ensure_team,
        scheduler.submit_job,
        scheduler.cancel_job,
        *synthetic.methods(),
        *(promotions or PromotionActivities()).methods(),
    ]
    return Worker(
        client,
        task_queue=synthetic_task_queue(task_queue),
        workflows=list(SYNTHETIC_WORKFLOWS),
        activities=methods,
        interceptors=[guard] if guard is not None else [],
    )
