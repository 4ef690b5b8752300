"""The files behind a corpus or a pair set named in a recipe, found under the data root; what
they lack is a :class:`~forge_training.schema.RecipeError` naming the recipe's field. Kept apart
from :mod:`forge_training.validation` so the data readers need none of its imports."""

from __future__ import annotations

from pathlib import Path

from forge_kit.paths import resolve_data_path
from forge_training.schema import RecipeError


def corpus_files(corpus: str, field_name: str = "data.corpus") -> list[Path]:
    """The text files of a corpus (a file, ``.txt``/``.jsonl``/``.jsonl.gz``, or a directory of
    ``*.txt``); raises :class:`RecipeError` naming ``field_name`` when there is nothing to read."""
    path = resolve_data_path(corpus)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
    elif path.is_file():
        files = [path]
    else:
        raise RecipeError(f"{field_name}: {corpus!r} does not exist")
    if not files or all(p.stat().st_size == 0 for p in files):
        raise RecipeError(f"{field_name}: {corpus!r} is empty")
    return files


def pair_files(path: str, field_name: str = "pairs.path") -> list[Path]:
    """The ``.jsonl``/``.jsonl.gz`` files of a pair set; :class:`RecipeError` names ``field_name``."""
    root = resolve_data_path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    elif root.is_file():
        files = [root]
    else:
        raise RecipeError(f"{field_name}: {path!r} does not exist")
    if not files or all(p.stat().st_size == 0 for p in files):
        raise RecipeError(f"{field_name}: {path!r} holds no non-empty .jsonl or .jsonl.gz file")
    return files
