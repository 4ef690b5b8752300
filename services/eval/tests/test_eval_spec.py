"""Run specs: the hash is stable and moves with every field; suites and data hashes come from disk."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from forge_eval.spec import BenchmarkCatalog, RunSpec, normalize_options
from forge_kit import errors
from forge_kit.paths import resolve_data_path


def make_spec(**changes: object) -> RunSpec:
    base = RunSpec(
        suite="gsm8k",
        datasets={"gsm8k/test.jsonl": "ab" * 32},
        model_name="tiny",
        model_version="3",
        sampling=normalize_options({}),
        seed=7,
        limit=100,
        scorer_version="gsm8k-gen-1",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_hash_is_stable_and_ignores_key_order() -> None:
    first = make_spec()
    reordered = make_spec(sampling=dict(reversed(list(normalize_options({}).items()))))
    assert first.spec_hash() == make_spec().spec_hash() == reordered.spec_hash()
    assert len(first.spec_hash()) == 64
    assert RunSpec.from_dict(first.to_dict()).spec_hash() == first.spec_hash()


@pytest.mark.parametrize(
    "change",
    [
        {"suite": "bbh"},
        {"datasets": {"gsm8k/test.jsonl": "cd" * 32}},
        {"datasets": {"gsm8k/test.jsonl": "ab" * 32, "gsm8k/train.jsonl": "ef" * 32}},
        {"model_name": "other"},
        {"model_version": "4"},
        {"sampling": normalize_options({"temperature": "0.7"})},
        {"sampling": normalize_options({"max_tokens": "64"})},
        {"sampling": normalize_options({"top_p": "0.9"})},
        {"sampling": normalize_options({"num_fewshot": "5"})},
        {"seed": 8},
        {"limit": 0},
        {"scorer_version": "gsm8k-gen-2"},
    ],
)
def test_hash_changes_with_every_field(change: dict[str, object]) -> None:
    assert make_spec(**change).spec_hash() != make_spec().spec_hash()


def test_differences_ignore_the_model_only() -> None:
    assert make_spec(model_version="9").differences(make_spec()) == []
    assert make_spec(seed=1, limit=5).differences(make_spec()) == ["limit", "seed"]


def test_options_default_and_explicit_default_hash_alike() -> None:
    assert normalize_options({}) == normalize_options({"temperature": "0", "max_tokens": "256"})
    assert normalize_options({"temperature": "0.5"})["temperature"] == 0.5


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        ({"temprature": "0"}, "options.temprature", "unknown option"),
        ({"max_tokens": "lots"}, "options.max_tokens", "integer"),
        ({"temperature": "nan"}, "options.temperature", "finite"),
        ({"top_p": "0"}, "options.top_p", "between"),
        ({"num_fewshot": "-1"}, "options.num_fewshot", "between"),
    ],
)
def test_bad_options_name_the_field(options: dict[str, str], field: str, words: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        normalize_options(options)
    assert caught.value.field == field and words in caught.value.message


def test_real_benchmarks_are_found_and_match_the_manifest(catalog: BenchmarkCatalog) -> None:
    # vlm_shapes is generated, not fetched (`make data` runs `python -m forge_eval.vlm_data`)
    assert catalog.suites() == ["bbh", "gsm8k", "humaneval", "mmlu", "vlm_shapes"]
    hashes = catalog.dataset_hashes("gsm8k")
    assert set(hashes) == {"gsm8k/test.jsonl", "gsm8k/test_socratic.jsonl", "gsm8k/train.jsonl"}
    assert hashes["gsm8k/test.jsonl"].startswith("3730d312f6e34405")  # pinned in MANIFEST.tsv
    assert len(catalog.dataset_hashes("mmlu")) == 57 * 3  # dev, val and test CSVs


def test_default_setting_resolves_to_the_shared_data() -> None:
    assert (resolve_data_path("benchmarks") / "MANIFEST.tsv").is_file()


def test_changed_data_changes_the_hash_and_a_pinned_mismatch_refuses(tmp_path: Path) -> None:
    (tmp_path / "toy").mkdir()
    data = tmp_path / "toy" / "test.jsonl"
    data.write_text('{"q": 1}\n')
    (tmp_path / "toy" / "LICENSE").write_text("MIT")
    catalog = BenchmarkCatalog(tmp_path)
    first = catalog.dataset_hashes("toy")
    assert list(first) == ["toy/test.jsonl"]  # the licence is not data
    data.write_text('{"q": 2}\n')
    assert catalog.dataset_hashes("toy") != first
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    (tmp_path / "MANIFEST.tsv").write_text(
        f"path\tbytes\trows\tsha256_16\ntoy/test.jsonl\t9\t1\t{digest[:16]}\n"
    )
    assert BenchmarkCatalog(tmp_path).dataset_hashes("toy")["toy/test.jsonl"] == digest
    data.write_text('{"q": 3}\n')
    with pytest.raises(errors.ConflictError, match=r"toy/test\.jsonl .* MANIFEST\.tsv pins"):
        BenchmarkCatalog(tmp_path).dataset_hashes("toy")
