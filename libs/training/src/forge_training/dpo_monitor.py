"""Over-optimisation watched during DPO training (``dpo.monitor.*``).

Every ``interval`` steps (and once before the first, for the reference point) the monitor scores
the policy being trained:

- ``kl``: KL(policy ‖ reference) per response on responses the policy samples for held-out
  prompts — at each position of a sample the exact KL between the two next-token distributions,
  summed over the response, averaged over prompts (never negative; 0 at the start);
- ``proxy_reward``: the mean score the round's pinned reward model (``reward_model``, a Hugging
  Face sequence-classification folder) gives those responses — what optimisation pushes up;
- ``heldout_agreement``: the share of held-out human pairs where the policy's implicit reward
  ``beta (log pi - log ref)`` ranks the chosen response first (DPO's ``val_reward_accuracy``).

Samples use a fixed seed per prompt, so successive points differ only by the policy. When over
the last ``window`` measurements the proxy reward rose at every step while held-out agreement fell
at every step (:func:`forge_experiments.overoptimisation.overoptimised`), training stops early with the
reason. The trace goes to ``out`` (a path or object-store URL) as JSON after every point.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from forge_experiments.overoptimisation import overoptimised
from forge_kit.objectstore import ObjectStore


@dataclass(frozen=True)
class MonitorPoint:
    step: int
    kl: float
    sqrt_kl: float
    proxy_reward: float
    heldout_agreement: float


class DpoMonitor:
    """Scores the policy every ``interval`` steps and says when to stop (see the module docstring)."""

    def __init__(
        self,
        *,
        reward_model: str,
        reference: PreTrainedModel,
        prompts: Sequence[Sequence[int]],
        eos_id: int,
        interval: int,
        window: int,
        max_new_tokens: int,
        out: str = "",
        seed: int = 0,
        write: bool = True,
    ) -> None:
        self.reward = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
        self.reference = reference
        self.prompts = [list(p) for p in prompts]
        self.eos_id = eos_id
        self.interval = interval
        self.window = window
        self.max_new_tokens = max_new_tokens
        self.out = out
        self.seed = seed
        self.write = write
        self.points: list[MonitorPoint] = []
        self.stop_reason = ""

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    @torch.no_grad()
    def _sample(self, policy: PreTrainedModel, prompt: list[int], index: int) -> list[int]:
        # Sampled on the CPU whatever the policy's device: the same draws on a GPU and a CPU.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        device = next(policy.parameters()).device
        ids = torch.tensor([prompt], device=device)
        response: list[int] = []
        for _ in range(self.max_new_tokens):
            logits = policy(input_ids=ids, use_cache=False).logits[0, -1].float().cpu()
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            response.append(token)
            if token == self.eos_id:
                break
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        return response

    @torch.no_grad()
    def _kl(self, policy: PreTrainedModel, prompt: list[int], response: list[int]) -> float:
        ids = torch.tensor([prompt + response], device=next(policy.parameters()).device)
        start = len(prompt) - 1
        p = torch.log_softmax(policy(input_ids=ids, use_cache=False).logits[0, start:-1].float(), -1)
        q = torch.log_softmax(self.reference(input_ids=ids, use_cache=False).logits[0, start:-1].float(), -1)
        return float((p.exp() * (p - q)).sum(-1).clamp(min=0).sum())

    @torch.no_grad()
    def measure(self, step: int, policy: PreTrainedModel, heldout_agreement: float) -> MonitorPoint:
        """One point of the trace; ends training (``stop_reason``) when over-optimisation shows."""
        was_training = policy.training
        policy.eval()
        kls, rewards = [], []
        for index, prompt in enumerate(self.prompts):
            response = self._sample(policy, prompt, index)
            kls.append(self._kl(policy, prompt, response))
            reward_ids = torch.tensor([prompt + response], device=next(self.reward.parameters()).device)
            score = self.reward(input_ids=reward_ids).logits
            rewards.append(float(score.reshape(-1)[0]))
        if was_training:
            policy.train()
        kl = sum(kls) / max(len(kls), 1)
        point = MonitorPoint(
            step=step,
            kl=kl,
            sqrt_kl=math.sqrt(max(kl, 0.0)),
            proxy_reward=sum(rewards) / max(len(rewards), 1),
            heldout_agreement=heldout_agreement,
        )
        self.points.append(point)
        if not self.stop_reason and overoptimised(
            [p.proxy_reward for p in self.points], [p.heldout_agreement for p in self.points], self.window
        ):
            trace = ", ".join(
                f"step {p.step}: proxy {p.proxy_reward:.4f}, agreement {p.heldout_agreement:.3f}"
                for p in self.points[-(self.window + 1) :]
            )
            self.stop_reason = (
                f"over-optimisation at step {step}: proxy reward rose while held-out agreement fell over the "
                f"last {self.window} check(s) ({trace})"
            )
        self._write()
        return point

    def report(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "window": self.window,
            "points": [p.__dict__ for p in self.points],
            "early_stop": self.stop_reason,
        }

    def _write(self) -> None:
        if not (self.out and self.write):
            return
        base, _, name = self.out.rpartition("/")
        ObjectStore(base or ".").put_bytes(name, json.dumps(self.report(), indent=2).encode())
