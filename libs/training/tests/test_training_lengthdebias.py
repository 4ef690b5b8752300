"""Length debiasing of reward models (``pairs.length_balance``, ``reward.length_head``).

The synthetic test makes length a confounder: the chosen reply of a training pair is the better
one by a hidden quality (seen through noise), and also the longer one 90 % of the time. A plain
Bradley-Terry model leans on length and fails on pairs where the better reply is the shorter one;
the reweighted loss and ODIN's quality head (the loss of :mod:`lengthdebias`, its penalty on the
same model) do not, and ODIN's quality score is decorrelated from length.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from forge_experiments import rmlength
from forge_training import recipes, validation
from forge_training.objectives import lengthdebias as ld
from forge_training.recipes import RecipeError
from forge_training.rm import eval as rm_eval
from forge_training.run import EXIT_BAD_RECIPE, main


def test_reweighting_gives_each_length_group_half_the_weight() -> None:
    groups = ["preferred_longer"] * 6 + ["preferred_shorter"] * 2 + ["tie"]
    weights = ld.balance_weights(groups)
    assert weights[:6] == [pytest.approx(8 / 12)] * 6 and weights[6:8] == [2.0, 2.0] and weights[8] == 1.0
    assert sum(weights[:6]) == pytest.approx(sum(weights[6:8])) == pytest.approx(4.0)
    assert ld.balance_weights(["preferred_longer", "tie"]) == [1.0, 1.0]  # nothing to balance against


def test_subsampling_keeps_equal_groups_and_every_tie() -> None:
    groups = ["preferred_longer"] * 7 + ["preferred_shorter"] * 3 + ["tie"] * 2
    keep = ld.balance_subsample(groups, seed=5)
    kept = [groups[i] for i in keep]
    assert kept.count("preferred_longer") == kept.count("preferred_shorter") == 3 and kept.count("tie") == 2
    assert keep == sorted(set(keep)) and keep == ld.balance_subsample(groups, seed=5)


def _confounded(n: int, longer_share: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` pairs as features ``[2n, 2]`` (chosen rows then rejected rows: noisy quality, length
    / 50) and lengths in words ``[2n]``; the chosen reply is the better one and the longer one
    with probability ``longer_share``."""
    q = torch.randn(n, 2, generator=gen)
    good, bad = q.max(1).values, q.min(1).values
    short = torch.randint(5, 40, (n,), generator=gen).float()
    long = short + torch.randint(10, 60, (n,), generator=gen).float()
    chosen_longer = torch.rand(n, generator=gen) < longer_share
    len_good = torch.where(chosen_longer, long, short)
    len_bad = torch.where(chosen_longer, short, long)
    quality = torch.cat([good, bad]) + 1.0 * torch.randn(2 * n, generator=gen)
    lengths = torch.cat([len_good, len_bad])
    return torch.stack([quality, lengths / 50], 1), lengths


def _train(mode: str) -> tuple[float, float]:
    """Train a small two-layer reward model on confounded pairs; its held-out accuracy on pairs
    whose better reply is the shorter one, and the correlation of its (quality) score with length
    on pairs where length says nothing of quality."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # tiny ops: more threads only spin against other jobs
        return _fit(mode)
    finally:
        torch.set_num_threads(threads)


def _fit(mode: str) -> tuple[float, float]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    labels = 2 if mode == "odin" else 1
    body = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh())
    head = torch.nn.Linear(16, labels)
    opt = torch.optim.Adam([*body.parameters(), *head.parameters()], lr=0.02)
    for _ in range(250):
        x, lengths = _confounded(32, 0.9, gen)
        groups = [
            "preferred_longer" if a > b else "preferred_shorter" for a, b in lengths.view(2, -1).T.tolist()
        ]
        weight = torch.tensor(ld.balance_weights(groups) if mode == "reweight" else [1.0] * 32)
        loss, _ = ld.debiased_loss(head(body(x)), weight, lengths, head.weight if labels == 2 else None)
        opt.zero_grad()
        (loss / 32).backward()
        opt.step()
    x, _ = _confounded(2000, 0.0, gen)  # every better reply is the shorter one
    with torch.no_grad():
        chosen, rejected = head(body(x))[:, ld.QUALITY].chunk(2)
    accuracy = rmlength.stratified_accuracy(["preferred_shorter"] * 2000, chosen.tolist(), rejected.tolist())[
        "preferred_shorter"
    ].accuracy
    x, lengths = _confounded(2000, 0.5, gen)  # length unrelated to quality
    with torch.no_grad():
        score = head(body(x))[:, ld.QUALITY]
    return accuracy, float(ld.pearson(score, lengths, min_std=0.0))


def test_debiasing_makes_the_reward_judge_quality_where_length_is_a_confounder() -> None:
    plain_acc, plain_rho = _train("plain")
    reweight_acc, _ = _train("reweight")
    odin_acc, odin_rho = _train("odin")
    # The plain model learned "longer is better": below chance where the better reply is shorter.
    assert plain_acc < 0.5 and plain_rho > 0.3
    assert reweight_acc > plain_acc + 0.15 and reweight_acc > 0.6
    assert odin_acc > plain_acc + 0.15 and odin_acc > 0.6
    assert abs(odin_rho) < 0.2 < plain_rho  # the quality head is decorrelated from length


def test_odin_penalty_rewards_a_length_head_and_punishes_a_length_quality_score() -> None:
    lengths = torch.arange(8.0)
    heads = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # orthogonal
    good, _, _ = ld.odin_penalty(torch.tensor([1.0, -1.0] * 4), lengths * 0.5, lengths, heads, 1.0, 1.0)
    bad, rho_q, _ = ld.odin_penalty(lengths * 0.5, torch.tensor([1.0, -1.0] * 4), lengths, heads, 1.0, 1.0)
    assert rho_q == pytest.approx(1.0, abs=1e-4) and bad > good
    skewed = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    worse, _, _ = ld.odin_penalty(torch.tensor([1.0, -1.0] * 4), lengths * 0.5, lengths, skewed, 1.0, 1.0)
    assert worse == pytest.approx(float(good) + 1.0)  # |w_q . w_l| = 1


def test_bad_debias_options_are_refused_before_starting(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"pairs\.length_balance: must be one of"):
        validation.validate(recipes.build("reward_hh_minilm", {"pairs.length_balance": "yes"}), 1)
    with pytest.raises(RecipeError, match=r"reward\.length_head: the length correlation"):
        validation.validate(
            recipes.build("reward_hh_minilm", {"reward.length_head": "true", "micro_batch_size": "1"}), 1
        )
    with pytest.raises(RecipeError, match=r"pairs\.length_balance: needs a bundled encoder"):
        validation.validate(recipes.build("reward_hh", {"pairs.length_balance": "reweight"}), 1)
    with pytest.raises(RecipeError, match="not used by the 'sft' task"):
        recipes.build("sft_hh", {"reward.length_head": "true"})
    with pytest.raises(RecipeError, match="must be >= 0"):
        validation.validate(recipes.build("reward_hh_minilm", {"reward.length_corr_weight": "-1"}), 1)
    args = ["--recipe", "reward_hh_minilm", "--run-dir", str(tmp_path), "--set", "pairs.length_balance=x"]
    assert main(args) == EXIT_BAD_RECIPE


TINY = {
    "pairs.max_pairs": "60",
    "data.seq_len": "48",
    "max_steps": "2",
    "global_batch_size": "8",
    "micro_batch_size": "4",
    "eval_interval": "2",
    "eval_batches": "5",
    "optim.warmup_steps": "1",
    "checkpoint.interval_steps": "0",
    "log_interval": "1",
    "pairs.length_balance": "reweight",
    "reward.length_head": "true",
}


def test_an_odin_run_exports_its_quality_head_as_a_one_label_reward_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import BertForSequenceClassification

    run_dir = tmp_path / "run"
    args = ["--recipe", "reward_hh_minilm", "--run-dir", str(run_dir), "--run-id", "odin"]
    for key, value in TINY.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2 and all(-1.0 <= m["corr_quality_length"] <= 1.0 for m in steps)
    manifest = json.loads((run_dir / "objects/checkpoints/odin/step-00000002/manifest.json").read_text())
    meta = manifest["meta"]
    assert meta["length_head"] is True and meta["length_balance"] == "reweight"
    assert (
        sum(meta["train_strata"].values())
        == meta["train_strata"]["preferred_longer"]
        + meta["train_strata"]["preferred_shorter"]
        + meta["train_strata"]["tie"]
        > 0
    )
    final = summary["eval"]  # held-out accuracy by which reply is longer, the groups adding up
    counted = [final[f"eval_pairs_{g}"] for g in rmlength.STRATA]
    assert sum(counted) == final["eval_pairs"]
    wins = sum(
        final.get(f"pairwise_accuracy_{g}", 0.0) * c for g, c in zip(rmlength.STRATA, counted, strict=True)
    )
    assert wins / final["eval_pairs"] == pytest.approx(final["pairwise_accuracy"])
    export = Path(summary["export_dir"])
    exported = BertForSequenceClassification.from_pretrained(export)
    assert exported.config.num_labels == 1
    # forge rm eval on the export gives the held-out accuracy the run reported (the quality head).
    held = run_dir / "data" / "held_out_pairs.jsonl"
    model = rm_eval.RewardModel(export)
    scores = rm_eval.evaluate(model, rm_eval.read_pairs(held, Counter()))
    result = scores.summary()
    assert result["accuracy"] == pytest.approx(final["pairwise_accuracy"])
    shorter = result["by_length"]["preferred_shorter"]
    assert shorter["n"] == final["eval_pairs_preferred_shorter"]
    if shorter["n"]:
        assert shorter["accuracy"] == pytest.approx(final["pairwise_accuracy_preferred_shorter"])
