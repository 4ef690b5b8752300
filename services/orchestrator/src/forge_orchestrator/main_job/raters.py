"""The main job's simulated raters for the online RLHF round: the rule-based rater pool
(``sim-rater-<n>``, the names the ``preferences`` step's pool rates under) answering, over the
feedback service's gRPC API as any rater would, the comparisons the round made from the
policy's own samples.

Their rule is the full-stop rule of the ``preferences`` step's seed data, applied to the two
texts they are shown: the response with more full stops is better, and of two with as many, the
shorter one (a tie when both are equal). Each takes :data:`DWELL_S` per item, above the rater-quality
"too fast" threshold, so quality judges them like anyone else. They rate until told to stop (the
round has what it waits for, or ended); an empty queue makes them wait and ask again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from forge.common.v1 import common_pb2
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc

from forge_kit.grpckit import make_channel

DWELL_S = 3.2
IDLE_S = 1.0


def rule_choice(response_a: str, response_b: str) -> int:
    """The rule-based rater's answer: more full stops wins, then the shorter text, else a tie."""
    a, b = (response_a.count("."), -len(response_a)), (response_b.count("."), -len(response_b))
    if a == b:
        return common_pb2.PREFERENCE_CHOICE_TIE
    return common_pb2.PREFERENCE_CHOICE_A if a > b else common_pb2.PREFERENCE_CHOICE_B


@dataclass
class RaterPool:
    """``raters`` rule-based raters on the feedback service at ``target``."""

    target: str
    token: str
    raters: int = 12
    dwell_s: float = DWELL_S
    answered: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """The last error each rater met (the service away, a refused answer); they carry on."""

    async def run(self, stop: asyncio.Event) -> int:
        """Rate until ``stop`` is set; the number of answers given."""
        async with make_channel(self.target, token=self.token) as channel:
            stub = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
            await asyncio.gather(*(self._rater(stub, f"sim-rater-{i + 1}", stop) for i in range(self.raters)))
        return sum(self.answered.values())

    async def _rater(
        self, stub: feedback_pb2_grpc.PreferenceFeedbackServiceAsyncStub, rater: str, stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            try:
                await self._rate_one(stub, rater, stop)
            except grpc.aio.AioRpcError as exc:
                self.errors[rater] = f"{exc.code().name}: {exc.details()}"
                await _wait(stop, IDLE_S)

    async def _rate_one(
        self, stub: feedback_pb2_grpc.PreferenceFeedbackServiceAsyncStub, rater: str, stop: asyncio.Event
    ) -> None:
        reply = await stub.GetNextComparison(
            feedback_pb2.GetNextComparisonRequest(rater_id=rater), timeout=10
        )
        if not reply.HasField("comparison"):
            await _wait(stop, IDLE_S)
            return
        item = reply.comparison
        if await _wait(stop, self.dwell_s):
            return  # the round has moved on; the lease runs out and the item goes to others
        await stub.SubmitPreference(
            feedback_pb2.SubmitPreferenceRequest(
                comparison_id=item.id,
                rater_id=rater,
                choice=rule_choice(item.response_a.text, item.response_b.text),  # type: ignore[arg-type]
                confidence=0.9,
            ),
            timeout=10,
        )
        self.answered[rater] = self.answered.get(rater, 0) + 1


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``stop`` is set first; True when it was."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True
