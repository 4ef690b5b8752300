"""Step 1 of an RLHF round, the preferences it trains on (part of :class:`~.rlhf.RlhfWorkflow`).

- **Online** (``sample_model`` set): sample the current policy on the prompt pool through the
  gateway and queue the pairs for raters (``rlhf_queue_policy_samples``, :mod:`.sampling`),
  with the canary shadow pairs of the policy's alias when it has a shadow
  (``rlhf_queue_shadow_pairs``, :mod:`.shadow`; a cursor keeps each pair to one round),
  then wait, with durable timers between polls, until the round's own comparisons have
  ``min_policy_pairs`` accepted preferences from at least ``min_raters`` raters that rater
  quality does not flag. The wait has a deadline (``buffer_timeout_s``): raters who do not answer
  in time end the round ``stalled``, with the counts, not hung.
- **Offline**: wait until ``min_new_pairs`` accepted pairs were recorded after the previous
  round's snapshot (whatever the comparisons), with the same deadline and ending.
"""

from __future__ import annotations

from abc import abstractmethod
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.rlhf.activities import BatchStats, PairStats, RlhfActivities
    from forge_orchestrator.rlhf.model import RlhfInput, RoundRecord, round_batch, stall_reason
    from forge_orchestrator.rlhf.sampling import CollectInput, CollectResult, RlhfSampler
    from forge_orchestrator.rlhf.shadow import ShadowInput, ShadowPairs, ShadowResult, alias_name

FEEDBACK_TIMEOUT = timedelta(minutes=5)
"""Exports and rater-quality passes scan every preference; they get longer than plain calls."""
SAMPLING_TIMEOUT = timedelta(minutes=30)


class RoundCollection:
    """The collection step; the workflow provides ``_activity``, ``_report``, ``_end`` and ``_step``."""

    _step: str
    _shadow_after_id: int = 0
    """The cursor of the canary shadow pairs queued so far (pairs after it are new)."""

    @abstractmethod
    async def _activity(self, method: Any, arg: Any, timeout: timedelta = ...) -> Any:
        """Run an activity (the workflow's retry and timeout policy)."""

    @abstractmethod
    async def _report(self, record: RoundRecord, **metrics: float) -> None:
        """Record the round's progress."""

    @abstractmethod
    async def _end(self, record: RoundRecord, status: str, reason: str, **metrics: float) -> None:
        """End the round with ``status`` and ``reason``."""

    async def _collect(self, params: RlhfInput, record: RoundRecord) -> bool:
        """Online step 1; False when the round stalled (recorded as such)."""
        wid = workflow.info().workflow_id
        record.batch = round_batch(wid, record.round)
        record.step = f"sampling {params.sample_model} on the prompt pool"
        await self._report(record)
        collected: CollectResult = await self._activity(
            RlhfSampler.queue_policy_samples,
            CollectInput(
                batch=record.batch,
                model=params.sample_model,
                seed=record.round,
                dataset=params.prompt_dataset,
                dataset_prompts=params.dataset_prompts,
                production_prompts=params.production_prompts,
                temperatures=list(params.temperatures),
                max_tokens=params.sample_max_tokens,
                max_prompt_chars=params.max_prompt_chars,
            ),
            SAMPLING_TIMEOUT,
        )
        record.prompts = {"dataset": collected.dataset_prompts, "production": collected.production_prompts}
        record.queued = collected.queued
        alias = params.shadow_alias or alias_name(params.sample_model)
        if params.shadow_pairs and alias and workflow.patched("rlhf-shadow-pairs"):
            shadow: ShadowResult = await self._activity(
                ShadowPairs.queue_shadow_pairs,
                ShadowInput(record.batch, alias, self._shadow_after_id, params.shadow_pairs),
            )
            self._shadow_after_id = shadow.next_after_id
            record.shadow_queued = shadow.queued
            record.queued += shadow.queued
        figures = {
            "dataset_prompts": float(collected.dataset_prompts),
            "production_prompts": float(collected.production_prompts),
            "queued": float(record.queued),
            "shadow_queued": float(record.shadow_queued),
        }
        if record.queued == 0:
            await self._end(
                record,
                "stalled",
                f"no comparison queued: the policy's samples gave none ({collected.skipped or 'no prompts'})",
                **figures,
            )
            return False
        started = workflow.now()
        deadline = started + timedelta(seconds=params.buffer_timeout_s)
        poll = params.poll_s
        while True:
            stats: BatchStats = await self._activity(
                RlhfActivities.batch_stats, record.batch, FEEDBACK_TIMEOUT
            )
            record.new_pairs = stats.accepted
            record.step = (
                f"waiting for raters ({stats.accepted}/{params.min_policy_pairs} accepted preferences, "
                f"{stats.raters} rater(s), on {stats.comparisons} policy comparisons)"
            )
            self._step = f"round {record.round}: {record.step}"
            waited = (workflow.now() - started).total_seconds()
            reason = stall_reason(
                stats.accepted,
                params.min_policy_pairs,
                stats.raters,
                params.min_raters,
                stats.answers,
                stats.comparisons,
                waited,
            )
            if not reason:
                await self._report(record, **figures, policy_pairs=float(stats.accepted))
                return True
            if workflow.now() >= deadline:
                record.step = "stalled waiting for raters"
                await self._end(record, "stalled", reason, **figures, policy_pairs=float(stats.accepted))
                return False
            await workflow.sleep(
                timedelta(seconds=min(poll, max(0.1, (deadline - workflow.now()).total_seconds())))
            )
            poll = min(poll * 2, max(params.max_poll_s, params.poll_s))

    async def _buffer(self, params: RlhfInput, watermark: str, record: RoundRecord) -> PairStats | None:
        """Offline step 1; None when the round stalled (recorded as such)."""
        deadline = workflow.now() + timedelta(seconds=params.buffer_timeout_s)
        poll = params.poll_s
        while True:
            stats: PairStats = await self._activity(
                RlhfActivities.preference_stats, watermark, FEEDBACK_TIMEOUT
            )
            record.new_pairs = stats.accepted_since
            record.step = f"buffering ({stats.accepted_since}/{params.min_new_pairs} new accepted pairs)"
            self._step = f"round {record.round}: {record.step}"
            if stats.accepted_since >= params.min_new_pairs:
                return stats
            if workflow.now() >= deadline:
                await self._end(
                    record,
                    "stalled",
                    f"raters did not answer in time: only {stats.accepted_since} new accepted pairs within "
                    f"{params.buffer_timeout_s:g}s (need {params.min_new_pairs})",
                )
                return None
            await workflow.sleep(timedelta(seconds=poll))
            poll = min(poll * 2, max(params.max_poll_s, params.poll_s))
