"""Corpus preparation shared by jobs: two processes preparing the same corpus into one cache at
once (as sweep trials on one node do) both get the complete preparation, and an incomplete one
left by a crash is replaced."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from forge_training import data
from forge_training.data import INDEX_FILE, TOKENIZER_FILE, prepare
from forge_training.schema import DataConfig


def _corpus(tmp_path: Path) -> DataConfig:
    text = "".join(
        f"line {i}: the quick brown fox {i * 7 % 13} jumps over {i % 5} lazy dogs\n" for i in range(3000)
    )
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return DataConfig(corpus=str(path), vocab_size=300, shard_tokens=4096)


def _prepare(config: DataConfig, cache: str) -> tuple[str, str]:
    prepared = prepare(config, Path(cache))
    return str(prepared.root), prepared.tokenizer_path.read_text()


def test_two_processes_preparing_one_corpus_at_once_share_one_complete_result(tmp_path: Path) -> None:
    config, cache = _corpus(tmp_path), tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        results = list(pool.map(_prepare, [config] * 4, [str(cache)] * 4))
    assert len({root for root, _ in results}) == 1 and len({tok for _, tok in results}) == 1
    root = Path(results[0][0])
    assert [p.name for p in cache.iterdir()] == [root.name]  # no working folder left behind
    alone = prepare(config, tmp_path / "alone")
    for split in ("train", "val"):
        index = json.loads((root / split / INDEX_FILE).read_text())
        assert index == json.loads((alone.root / split / INDEX_FILE).read_text())
        for shard in index["shards"]:
            assert (root / split / shard["file"]).read_bytes() == (
                alone.root / split / shard["file"]
            ).read_bytes()


def test_nothing_is_written_where_readers_look_until_the_preparation_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While it writes its shards, ``cache/<data hash>`` does not exist: a job that finds it
    there finds it whole (the writes go to a folder of the preparation's own, renamed after)."""
    config, cache = _corpus(tmp_path), tmp_path / "cache"
    digest = prepare(config, tmp_path / "probe").data_hash
    seen: list[tuple[Path, bool]] = []
    write = data._write_shards

    def watched(tokens: Any, out: Path, shard_tokens: int, chars: int) -> None:
        seen.append((out, (cache / digest).exists()))
        write(tokens, out, shard_tokens, chars)

    monkeypatch.setattr(data, "_write_shards", watched)
    prepare(config, cache)
    assert [(out.name, there) for out, there in seen] == [("train", False), ("val", False)]
    assert all(cache / digest not in out.parents for out, _ in seen)


def test_an_incomplete_preparation_is_replaced(tmp_path: Path) -> None:
    config, cache = _corpus(tmp_path), tmp_path / "cache"
    digest = prepare(config, tmp_path / "probe").data_hash
    broken = cache / digest
    (broken / "train").mkdir(parents=True)
    (broken / TOKENIZER_FILE).write_text("{}")  # a crash before the splits' indexes
    prepared = prepare(config, cache)
    assert prepared.root == broken and (broken / "val" / INDEX_FILE).is_file()
    assert prepared.tokenizer().get_vocab_size() == 300
