"""The ``dpo`` task: direct preference optimisation against a frozen copy of the parent."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from forge_training.dpo_monitor import DpoMonitor
from forge_training.mfu import forward_flops_per_token, train_flops_per_token
from forge_training.objectives.base import Micro, Objective, ObjectiveSpec, adopt, wins
from forge_training.objectives.pairwise import PreferenceTask, sequence_logps
from forge_training.parents import Parent
from forge_training.schema import TrainConfig


class DirectPreference(PreferenceTask):
    """DPO, sigmoid loss: ``-log sigmoid(beta ((log pi(y_c) - log ref(y_c)) - (log pi(y_r) -
    log ref(y_r))))``, log-probabilities summed over response tokens; the reference is a frozen
    copy of the parent (Rafailov et al. 2023; TRL's ``loss_type="sigmoid"`` computes the same)."""

    task = "dpo"
    figure_names = (
        "reward_chosen",
        "reward_rejected",
        "reward_margin",
        "reward_accuracy",
        "logratio_chosen",
        "logratio_rejected",
    )
    accuracy_name, margin_name = "val_reward_accuracy", "val_reward_margin"

    def make_model(self, parent: Parent) -> PreTrainedModel:
        model = adopt(parent, self.config.data.seq_len)
        self.reference = copy.deepcopy(model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.beta = self.config.dpo.beta
        self.monitor: DpoMonitor | None = None
        watch = self.config.dpo.monitor
        if watch.interval:
            # Held-out prompts: those of the pairs DPO does not train on (its validation split).
            prompts = [rows[0].ids[: rows[0].prompt_len] for rows in self.val_rows[: watch.prompts]]
            self.monitor = DpoMonitor(
                reward_model=watch.reward_model,
                reference=self.reference,
                prompts=prompts,
                eos_id=self.pad_id,
                interval=watch.interval,
                window=watch.window,
                max_new_tokens=watch.max_new_tokens,
                out=watch.out,
                seed=self.config.seed,
                write=self.rank == 0,
            )
        return model

    def to(self, device: torch.device) -> None:
        super().to(device)
        self.reference.to(device)
        if self.monitor is not None:
            self.monitor.reward.to(device)

    def start(self) -> dict[str, float]:
        baseline = self.evaluate()
        if self.monitor is not None:  # the reference point: KL 0, the starting proxy reward
            self.monitor.measure(0, self.model, baseline["val_reward_accuracy"])
        return baseline

    def early_stop(self, step: int) -> str:
        """Every ``dpo.monitor.interval`` steps: a monitor point; its reason once over-optimisation shows."""
        if self.monitor is None or not self.monitor.due(step):
            return ""
        self.monitor.measure(step, self.model, self.evaluate()["val_reward_accuracy"])
        return self.monitor.stop_reason

    def flops(self, micro: Micro) -> float:
        cfg, width = self.model.config, micro["input_ids"].size(1)
        per_token = train_flops_per_token(cfg, cfg.vocab_size, width) + forward_flops_per_token(
            cfg, cfg.vocab_size, width
        )
        return float(micro["attention_mask"].sum()) * per_token

    def logratios(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
        """Per pair: log pi - log ref of the chosen and of the rejected response."""
        kwargs = {
            "input_ids": micro["input_ids"],
            "attention_mask": micro["attention_mask"],
            "use_cache": False,
        }
        policy, _ = sequence_logps(module(**kwargs).logits, micro["labels"])
        with torch.no_grad():
            reference, _ = sequence_logps(self.reference(**kwargs).logits, micro["labels"])
        ratio = policy - reference
        chosen, rejected = ratio.chunk(2)
        return chosen, rejected

    def margins(self, module: torch.nn.Module, micro: Micro) -> torch.Tensor:
        chosen, rejected = self.logratios(module, micro)
        return self.beta * (chosen - rejected)

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        chosen, rejected = self.logratios(module, micro)
        margin = self.beta * (chosen - rejected)
        loss = -F.logsigmoid(margin).sum()
        c, r = chosen.detach(), rejected.detach()
        return loss, [
            float(self.beta * c.sum()),
            float(self.beta * r.sum()),
            float(margin.detach().sum()),
            wins(c - r),
            float(c.sum()),
            float(r.sum()),
        ]


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    return DirectPreference(config, rank, world_size)


SPEC = ObjectiveSpec("dpo", build, "DPO (sigmoid loss) against a frozen copy of the parent")
