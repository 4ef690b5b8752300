"""The file-size gate of ``make verify``: no source file over ``--limit`` lines (600).

Source is code written by hand under libs/*/src, libs/*/tests, services/*/src, services/*/tests,
tests, load, scripts and deploy, as git tracks it (plus untracked files git does not ignore).
Generated protobuf stubs (``*_pb2*.py``, ``*.pyi``) and data tables (JSON, YAML, TOML, CSV …)
are not source and are not counted.

A file still over the limit while it is being split is named in the allow-list
(``scripts/file_size_allowlist.txt``): one path a line, ``#`` comments. An entry that is no
longer over the limit, or no longer exists, fails the check too, so the list only shrinks.

    python scripts/check_file_sizes.py            # exit 1 naming every file over the limit
    python scripts/check_file_sizes.py --report   # every source file over 500 lines, largest first
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

from repofiles import repo_files

ROOT = Path(__file__).resolve().parent.parent
ALLOWLIST = Path("scripts") / "file_size_allowlist.txt"

ROOTS = (
    "libs/*/src/",
    "libs/*/tests/",
    "services/*/src/",
    "services/*/tests/",
    "tests/",
    "load/",
    "scripts/",
    "deploy/",
)
SOURCE_SUFFIXES = (".py", ".sh", ".sql", ".html", ".mako", ".js", ".ts")
GENERATED = ("*_pb2.py", "*_pb2_grpc.py", "*_pb2*.py")


def source_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files under the source roots, as repo-relative paths."""
    return [
        path
        for path in repo_files(root)
        if any(fnmatch.fnmatch(path, pattern + "*") for pattern in ROOTS)
        and path.endswith(SOURCE_SUFFIXES)
        and not any(fnmatch.fnmatch(Path(path).name, g) for g in GENERATED)
    ]


def line_count(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for _ in fh)


def read_allowlist(path: Path) -> set[str]:
    if not path.exists():
        return set()
    entries = set()
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            entries.add(line)
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=600, help="most lines a source file may have")
    parser.add_argument(
        "--allowlist", type=Path, default=ALLOWLIST, help="files still allowed over the limit"
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    parser.add_argument("--report", action="store_true", help="list files over 500 lines and exit 0")
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error("--limit must be at least 1")

    sizes = {path: line_count(args.root / path) for path in source_files(args.root)}
    if args.report:
        for path, n in sorted(sizes.items(), key=lambda item: -item[1]):
            if n > 500:
                print(f"{n:6d} {path}")
        return 0

    allowlist = args.allowlist or args.root / ALLOWLIST
    allowed = read_allowlist(allowlist)
    over = {path: n for path, n in sizes.items() if n > args.limit}
    failures = [
        f"{path}: {n} lines (limit {args.limit})" for path, n in sorted(over.items()) if path not in allowed
    ]
    failures += [
        f"{path}: in {allowlist.name} but "
        + ("missing" if path not in sizes else f"{sizes[path]} lines, within the limit")
        + ": remove the entry"
        for path in sorted(allowed - over.keys())
    ]
    if failures:
        print(
            "check_file_sizes: split these files (or, while a split is under way, list them):",
            file=sys.stderr,
        )
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(
        f"check_file_sizes: {len(sizes)} source files, none over {args.limit} lines ({len(allowed)} allowed)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
