"""Drift and over-optimisation figures of policy checkpoints against their reference, for RLHF.

``python -m forge_training.policy_check --reference DIR --reward-model DIR --pairs
FILE --out OUT --policy DIR [--policy DIR ...]`` writes ``OUT/summary.json`` with, per policy:

- ``kl``: KL(policy ‖ reference) per response, estimated on responses the policy samples for
  the held-out prompts: at each position of a sample the exact KL between the two next-token
  distributions, summed over the response and averaged over prompts (an unbiased estimate of
  the sequence KL with far less variance than ``log π(y) − log π_ref(y)``, and never negative);
- ``proxy_reward``: the mean reward the pinned reward model gives those responses (what the
  optimisation pushes up), next to ``reference_proxy_reward`` of the reference's own samples;
- ``heldout_agreement``: on the held-out human pairs, the share where the policy's implicit
  reward ``log π − log π_ref`` ranks the human-chosen response above the rejected one (a tie
  counts one half; the reference itself scores exactly 0.5).

Gao et al. (2022) plot the gold reward against ``sqrt(KL)``; held-out human agreement plays the
gold reward here: a proxy reward that rises while agreement falls is over-optimisation.
Needs torch and transformers; run as a job on a trainer node.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from forge_training.rm.eval import Pair, PairsError, RewardModel, read_pairs


class CausalLm:
    """A Hugging Face causal LM folder with its tokenizer and chat template, on CPU."""

    def __init__(self, folder: Path, *, max_new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not (folder / "config.json").is_file():
            raise PairsError(f"{folder} has no config.json (not a Hugging Face model folder)")
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.eos_id = self.tokenizer.eos_token_id
        limit = int(getattr(self.model.config, "max_position_embeddings", 0) or 512)
        self.max_new_tokens = max_new_tokens
        self.max_prompt = max(8, limit - max_new_tokens)

    def prompt_ids(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        turns = [{"role": role, "content": content} for role, content in messages]
        if getattr(self.tokenizer, "chat_template", None):
            text = str(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        else:  # a pre-trained policy has no template yet: the one the trainer's pair tasks use
            eos = self.tokenizer.eos_token or ""
            text = "".join(
                f"User: {t['content']}\n" if t["role"] == "user" else f"Assistant: {t['content']}{eos}\n"
                for t in turns
            )
            text += "Assistant:"
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids[-self.max_prompt :]

    def sample(self, prompt: list[int], generator: Any) -> list[int]:
        """One response sampled at temperature 1 (no top-k/top-p: the policy's own distribution)."""
        torch = self._torch
        ids = torch.tensor([prompt], dtype=torch.long)
        out: list[int] = []
        with torch.inference_mode():
            past = None
            step_input = ids
            for _ in range(self.max_new_tokens):
                result = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = result.past_key_values
                probs = torch.softmax(result.logits[0, -1].float(), dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                out.append(token)
                if token == self.eos_id:
                    break
                step_input = torch.tensor([[token]], dtype=torch.long)
        return out

    def logits(self, prompt: list[int], response: list[int]) -> Any:
        """Next-token logits at the positions that predict the response tokens."""
        torch = self._torch
        ids = torch.tensor([prompt + response], dtype=torch.long)
        with torch.inference_mode():
            return self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()

    def logprob(self, prompt: list[int], response: list[int]) -> float:
        """``Σ log p(response | prompt)`` over the response tokens."""
        torch = self._torch
        ids = torch.tensor([prompt + response], dtype=torch.long)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        targets = ids[0, 1:]
        picked = logp.gather(1, targets.unsqueeze(-1)).squeeze(-1)
        return float(picked[len(prompt) - 1 :].sum())


def _kl_along(policy: CausalLm, ref: CausalLm, prompt: list[int], response: list[int]) -> float:
    """``Σ_t KL(π(·|y_<t) ‖ π_ref(·|y_<t))`` over the positions of ``response``."""
    torch = policy._torch
    logp = torch.log_softmax(policy.logits(prompt, response), dim=-1)
    logq = torch.log_softmax(ref.logits(prompt, response), dim=-1)
    return float((logp.exp() * (logp - logq)).sum())


def _reward(rm: RewardModel, messages: tuple[tuple[str, str], ...], response: str) -> float:
    return rm.reward(messages, response)


def _samples(lm: CausalLm, pairs: list[Pair], seed: int) -> list[tuple[list[int], list[int], str]]:
    generator = lm._torch.Generator().manual_seed(seed)
    out = []
    for pair in pairs:
        prompt = lm.prompt_ids(pair.messages)
        response = lm.sample(prompt, generator)
        text = str(lm.tokenizer.decode([t for t in response if t != lm.eos_id])).strip()
        out.append((prompt, response, text))
    return out


def score_policies(
    policies: list[Path],
    reference: Path,
    reward_model: Path,
    pairs: list[Pair],
    *,
    max_new_tokens: int = 24,
    max_prompts: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """The figures above for each policy (see the module docstring)."""
    if not pairs:
        raise PairsError("--pairs: no scorable pair in the file")
    ref = CausalLm(reference, max_new_tokens=max_new_tokens)
    rm = RewardModel(reward_model)
    prompts = pairs[:max_prompts]
    ref_samples = _samples(ref, prompts, seed)
    reference_proxy = sum(
        _reward(rm, p.messages, text) for p, (_, _, text) in zip(prompts, ref_samples, strict=True)
    ) / len(prompts)
    ref_human = [
        (ref.logprob(ids, _ids(ref, p.chosen)), ref.logprob(ids, _ids(ref, p.rejected)))
        for p in pairs
        for ids in [ref.prompt_ids(p.messages)]
    ]
    points = []
    for folder in policies:
        policy = CausalLm(folder, max_new_tokens=max_new_tokens)
        samples = _samples(policy, prompts, seed)
        kl = sum(_kl_along(policy, ref, pr, resp) for pr, resp, _ in samples) / len(samples)
        proxy = sum(_reward(rm, p.messages, text) for p, (_, _, text) in zip(prompts, samples, strict=True))
        wins = 0.0
        for p, (ref_chosen, ref_rejected) in zip(pairs, ref_human, strict=True):
            ids = policy.prompt_ids(p.messages)
            chosen = policy.logprob(ids, _ids(policy, p.chosen)) - ref_chosen
            rejected = policy.logprob(ids, _ids(policy, p.rejected)) - ref_rejected
            wins += 1.0 if chosen > rejected else 0.5 if chosen == rejected else 0.0
        points.append(
            {
                "policy": str(folder),
                "kl": kl,
                "sqrt_kl": math.sqrt(kl),
                "proxy_reward": proxy / len(prompts),
                "heldout_agreement": wins / len(pairs),
            }
        )
    return {
        "reference": str(reference),
        "reward_model": str(reward_model),
        "reference_proxy_reward": reference_proxy,
        "prompts": len(prompts),
        "pairs": len(pairs),
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "points": points,
    }


def _ids(lm: CausalLm, response: str) -> list[int]:
    ids = list(lm.tokenizer(" " + response, add_special_tokens=False)["input_ids"])
    return ids[: lm.max_new_tokens * 4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge_training.policy_check")
    parser.add_argument("--policy", type=Path, action="append", required=True, help="policy HF folder")
    parser.add_argument("--reference", type=Path, required=True, help="reference policy HF folder")
    parser.add_argument("--reward-model", type=Path, required=True, help="reward-model HF folder")
    parser.add_argument("--pairs", type=Path, required=True, help="held-out HH-RLHF pairs (.jsonl[.gz])")
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--max-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        pairs = list(read_pairs(args.pairs, Counter()))
        summary = score_policies(
            args.policy,
            args.reference,
            args.reward_model,
            pairs,
            max_new_tokens=args.max_new_tokens,
            max_prompts=args.max_prompts,
            seed=args.seed,
        )
    except PairsError as exc:
        print(f"policy_check: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / ".summary.json.partial"
    partial.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    partial.replace(args.out / "summary.json")
    print(json.dumps(summary["points"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
