"""ObjectStore on a local directory: atomic writes, listing, key validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_kit.objectstore import ObjectStore


def test_put_get_list_delete(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "objects"))
    store.put_bytes("ckpt/run-1/step-10/model.bin", b"weights")
    store.put_bytes("ckpt/run-1/manifest.json", b"{}")
    store.put_bytes("datasets/a.txt", b"a")
    assert store.get_bytes("ckpt/run-1/step-10/model.bin") == b"weights"
    assert store.exists("datasets/a.txt")
    assert store.list() == [
        "ckpt/run-1/manifest.json",
        "ckpt/run-1/step-10/model.bin",
        "datasets/a.txt",
    ]
    assert store.list("ckpt/run-1/step-10") == ["ckpt/run-1/step-10/model.bin"]
    assert store.list("nothing-here") == []
    store.delete("ckpt", recursive=True)
    assert store.list() == ["datasets/a.txt"]
    assert store.url("datasets/a.txt") == str(tmp_path / "objects" / "datasets" / "a.txt")


def test_failed_atomic_write_leaves_nothing(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path))
    store.put_bytes("model.bin", b"old")
    with pytest.raises(RuntimeError), store.open_atomic("model.bin") as handle:
        handle.write(b"half of the new")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError), store.open_atomic("fresh.bin") as handle:
        handle.write(b"partial")
        raise RuntimeError("killed")
    assert store.get_bytes("model.bin") == b"old"
    assert not store.exists("fresh.bin")
    assert store.list() == ["model.bin"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["model.bin"]


def test_object_appears_only_when_the_write_completes(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path))
    with store.open_atomic("ckpt/manifest.json") as handle:
        handle.write(b"{")
        assert not store.exists("ckpt/manifest.json")
        assert store.list() == []
        handle.write(b"}")
    assert store.get_bytes("ckpt/manifest.json") == b"{}"


@pytest.mark.parametrize("key", ["../escape", "a/../../escape", "", ".", "/..", "a/b/../../.."])
def test_keys_escaping_the_root_are_rejected(tmp_path: Path, key: str) -> None:
    store = ObjectStore(str(tmp_path / "root"))
    with pytest.raises(ValueError, match="invalid object key"):
        store.put_bytes(key, b"x")
    assert not (tmp_path / "escape").exists()


def test_keys_that_only_look_odd_are_fine(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path))
    store.put_bytes("..hidden/x", b"1")
    store.put_bytes("/leading/slash", b"2")
    store.put_bytes("a/./b/../c", b"3")
    assert store.list() == ["..hidden/x", "a/c", "leading/slash"]
