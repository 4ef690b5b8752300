"""HH-RLHF parsing on real lines, including the pairs that must be filtered out."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import pytest

from forge_preference_feedback.seeds import (
    PairRejected,
    PreferencePair,
    ReadStats,
    arrange,
    read_hh_rlhf,
    split_pair,
)

Line = Callable[[str, int], dict[str, str]]


def test_a_real_pair_splits_into_prompt_and_two_responses(hh_line: Line) -> None:
    line = hh_line("helpful-base", 0)
    prompt, chosen, rejected = split_pair(line["chosen"], line["rejected"])
    assert prompt == "Human: Do you know why turkeys became the official food of thanksgiving?"
    assert chosen.startswith("To be honest, I don’t know anything about that.")
    assert rejected.startswith("I know that the American Indians were the first")
    assert line["chosen"] == f"\n\n{prompt}\n\nAssistant: {chosen}"


def test_a_multi_turn_prompt_keeps_earlier_turns(hh_line: Line) -> None:
    line = hh_line("helpful-base", 1)
    prompt, chosen, _ = split_pair(line["chosen"], line["rejected"])
    assert prompt.startswith("Human: How can I find out what types of butterflies")
    assert prompt.endswith("Human: Great. What are some common species then?")
    assert "Assistant: Which location are you in?" in prompt and chosen.startswith("About 150 species")


def test_real_identical_pair_is_rejected(hh_line: Line) -> None:
    line = hh_line("helpful-base", 721)
    assert line["chosen"] == line["rejected"]
    with pytest.raises(PairRejected) as caught:
        split_pair(line["chosen"], line["rejected"])
    assert caught.value.reason == "identical"


def test_real_mismatched_prefix_is_rejected(hh_line: Line) -> None:
    line = hh_line("helpful-base", 168)
    with pytest.raises(PairRejected) as caught:
        split_pair(line["chosen"], line["rejected"])
    assert caught.value.reason == "mismatched_prefix"


@pytest.mark.parametrize(
    ("chosen", "rejected", "reason"),
    [
        ("\n\nHuman: hi", "\n\nHuman: hi there", "no_assistant_turn"),
        ("\n\nHuman: hi\n\nAssistant: ", "\n\nHuman: hi\n\nAssistant: hello", "empty_response"),
        ("\n\nHuman: hi\n\nAssistant: hello", "\n\nHuman: hi\n\nAssistant:  hello ", "identical"),
    ],
)
def test_other_unusable_pairs_are_rejected(chosen: str, rejected: str, reason: str) -> None:
    with pytest.raises(PairRejected) as caught:
        split_pair(chosen, rejected)
    assert caught.value.reason == reason


def test_reading_the_real_files_mixes_subsets_and_counts_skips(hh_root: Path) -> None:
    stats = ReadStats()
    first = list(islice(read_hh_rlhf(hh_root, stats), 4))
    assert [p.source for p in first] == ["hh-rlhf/harmless-base", "hh-rlhf/helpful-base"] * 2
    assert first[1].key == "hh-rlhf/helpful-base/test.jsonl.gz:0"
    everything = list(read_hh_rlhf(hh_root, stats := ReadStats()))
    # 2,354 helpful + 2,312 harmless lines; 14 mismatched prefixes, 8 empty responses, 2 identical.
    assert len(everything) == stats.usable == 2354 + 2312 - 24
    assert stats.skipped == Counter({"mismatched_prefix": 14, "empty_response": 8, "identical": 2})
    assert len({p.key for p in everything}) == len(everything)


def test_a_subset_folder_can_be_read_on_its_own(tmp_path: Path, hh_line: Line) -> None:
    rows = [hh_line("harmless-base", i) for i in range(3)]
    with gzip.open(tmp_path / "test.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    stats = ReadStats()
    pairs = list(read_hh_rlhf(tmp_path, stats))
    assert len(pairs) == 3 and stats.skipped == Counter({"unreadable": 1})
    with pytest.raises(FileNotFoundError):
        list(read_hh_rlhf(tmp_path / "missing"))


def test_ab_order_is_seeded_per_pair_and_remembers_the_gold_side() -> None:
    pairs = [PreferencePair("s", f"s/k:{i}", "p", f"good {i}", f"bad {i}") for i in range(200)]
    shown = [arrange(p, rng_seed=1) for p in pairs]
    assert shown == [arrange(p, rng_seed=1) for p in pairs]  # reproducible
    assert 70 < sum(s.gold == "A" for s in shown) < 130  # both orders occur
    for pair, s in zip(pairs, shown, strict=True):
        assert (s.response_a if s.gold == "A" else s.response_b) == pair.chosen
    assert [arrange(p, rng_seed=2).gold for p in pairs] != [s.gold for s in shown]
