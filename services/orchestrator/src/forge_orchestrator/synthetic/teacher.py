"""The teacher client: problems and k solutions per problem from any OpenAI-compatible endpoint.

The format of the exchange (JSON in the chat messages) is :mod:`forge_experiments.teacher_protocol`. In
production the endpoint is vLLM serving a strong model; on a machine without one it is the
training library's programmatic teacher (``python -m forge_training.synthetic.teacher``), which
writes problems from templates and worked solutions with a configurable error rate.

A teacher is an unreliable service, and its answers are hostile input. Each call:

1. is sent with the ``openai`` SDK (its own retries off: the loop here counts them) under a
   per-call timeout;
2. on a **timeout**, a connection error or a 5xx: backs off (:class:`forge_kit.backoff.Backoff`,
   capped and jittered) and retries, up to ``max_attempts`` tries;
3. on a **429**: waits its ``Retry-After`` (at most ``max_retry_after_s``; without one, the
   backoff) and retries, within the same attempts;
4. on an answer that does not follow the format (**malformed**): retries, within the same attempts;
   in a solutions answer a malformed choice is dropped and counted, the others kept;
5. on any other 4xx (the teacher refuses the request): gives up at once.

A call that gives up returns nothing (counted in ``failed_calls`` with the last reason); it never
raises, so a bad teacher costs problems, never the workflow. :class:`TeacherStats` counts every
case for the workflow's result and its MLflow run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forge_experiments import teacher_protocol as tp
from forge_kit.backoff import Backoff, parse_retry_after

if TYPE_CHECKING:
    import openai

MAX_REASONS = 20


@dataclass
class TeacherStats:
    """What the client did, summed over its calls."""

    calls: int = 0
    """Calls made (each try of a call counts once)."""
    retries: int = 0
    malformed: int = 0
    """Answers that did not follow the format (each retried)."""
    malformed_choices: int = 0
    """Solutions dropped from an otherwise good answer."""
    timeouts: int = 0
    rate_limited: int = 0
    """429 answers."""
    server_errors: int = 0
    """5xx answers and connection errors."""
    refused: int = 0
    """Other 4xx answers (not retried)."""
    failed_calls: int = 0
    """Calls that gave up: their problems or solutions are missing."""
    reasons: list[str] = field(default_factory=list)
    """The last few reasons a call was retried or gave up."""

    def note(self, reason: str) -> None:
        self.reasons = [*self.reasons, reason[:300]][-MAX_REASONS:]

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "retries": self.retries,
            "malformed": self.malformed,
            "malformed_choices": self.malformed_choices,
            "timeouts": self.timeouts,
            "rate_limited": self.rate_limited,
            "server_errors": self.server_errors,
            "refused": self.refused,
            "failed_calls": self.failed_calls,
            "reasons": list(self.reasons),
        }


class _Retry(Exception):
    def __init__(self, reason: str, wait_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.wait_s = wait_s


class TeacherClient:
    """Calls one teacher endpoint (``base_url`` ends in ``/v1``) for ``model``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        token: str = "",
        *,
        timeout_s: float = 60.0,
        max_attempts: int = 4,
        backoff_s: tuple[float, float] = (0.5, 8.0),
        max_retry_after_s: float = 30.0,
        temperature: float = 0.8,
        max_tokens: int = 1024,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        # The SDK is imported when a client is made: the orchestrator's start-up does not pay for it.
        import openai

        self.model = model
        self.stats = TeacherStats()
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=token or "none", timeout=timeout_s, max_retries=0
        )
        self._attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_retry_after_s = max_retry_after_s
        self._temperature = temperature
        self._max_tokens = max_tokens

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> TeacherClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def problems(self, topic: str, count: int, seed: int) -> list[tp.TeacherProblem]:
        """Up to ``count`` problems about ``topic``; empty when the call gave up."""
        count = min(count, tp.MAX_PROBLEMS)

        def parse(reply: Any) -> list[tp.TeacherProblem]:
            if not reply.choices:
                raise tp.MalformedAnswer("no choices")
            return tp.parse_problems(reply.choices[0].message.content, count)

        found = await self._call(tp.problems_request(topic, count, seed), 1, seed, parse)
        return found or []

    async def solutions(self, problem: tp.TeacherProblem, k: int, seed: int) -> list[tp.TeacherSolution]:
        """Up to ``k`` solutions of ``problem`` (one per choice; malformed choices dropped)."""
        k = min(k, tp.MAX_SOLUTIONS)

        def parse(reply: Any) -> list[tp.TeacherSolution]:
            good: list[tp.TeacherSolution] = []
            bad: list[str] = []
            for choice in list(reply.choices)[:k]:
                try:
                    good.append(tp.parse_solution(choice.message.content))
                except tp.MalformedAnswer as exc:
                    bad.append(str(exc))
            if not good:  # nothing usable: the whole answer is malformed, try again
                raise tp.MalformedAnswer(bad[0] if bad else "no choices")
            if bad:
                self.stats.malformed_choices += len(bad)
                self.stats.note(f"malformed solution: {bad[0]}")
            return good

        found = await self._call(tp.solutions_request(problem, seed), k, seed, parse)
        return found or []

    async def _call(self, user: str, n: int, seed: int, parse: Any) -> Any:
        """Steps 1-5 of the module docstring; None when the call gave up."""
        import openai

        backoff = Backoff(*self._backoff_s)
        for attempt in range(1, self._attempts + 1):
            self.stats.calls += 1
            try:
                reply = await self._send(user, n, seed)
                try:
                    return parse(reply)
                except (AttributeError, TypeError, KeyError, IndexError) as exc:
                    raise tp.MalformedAnswer(f"not a chat completion ({type(exc).__name__})") from None
            except _Retry as retry:
                reason, wait = retry.reason, retry.wait_s
            except tp.MalformedAnswer as exc:
                self.stats.malformed += 1
                reason, wait = f"malformed answer: {exc}", None
            except openai.APIStatusError as exc:  # a 4xx other than 429: retrying cannot help
                self.stats.refused += 1
                self.stats.failed_calls += 1
                self.stats.note(f"refused: HTTP {exc.status_code}: {_message(exc)}")
                return None
            if attempt == self._attempts:
                self.stats.failed_calls += 1
                self.stats.note(f"gave up after {attempt} tries: {reason}")
                return None
            self.stats.retries += 1
            self.stats.note(reason)
            await asyncio.sleep(wait if wait is not None else backoff.next_delay())
        return None

    async def _send(self, user: str, n: int, seed: int) -> Any:
        import openai

        try:
            return await self._client.chat.completions.create(
                model=self.model,
                messages=[
                    {"role": "system", "content": tp.SYSTEM_PROMPT},
                    {"role": "user", "content": user},
                ],
                n=n,
                seed=seed,
                temperature=self._temperature,
                max_tokens=self._max_tokens,
            )
        except openai.APITimeoutError:
            self.stats.timeouts += 1
            raise _Retry("timed out") from None
        except openai.RateLimitError as exc:
            self.stats.rate_limited += 1
            after = parse_retry_after(exc.response.headers.get("retry-after"))
            wait = min(after, self._max_retry_after_s) if after is not None else None
            raise _Retry(f"rate limited (Retry-After {after})", wait) from None
        except openai.InternalServerError as exc:
            self.stats.server_errors += 1
            raise _Retry(f"HTTP {exc.status_code}: {_message(exc)}") from None
        except openai.APIConnectionError as exc:
            self.stats.server_errors += 1
            raise _Retry(f"connection error: {exc}") from None
        except openai.APIResponseValidationError as exc:  # a 2xx body that is not a completion
            raise tp.MalformedAnswer(f"not a chat completion: {exc}") from None


def _message(exc: openai.APIStatusError) -> str:
    return str(exc.message)[:200]
