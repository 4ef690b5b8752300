"""The chassis gate of ``make verify``: every ``forge_kit`` module is used by at least two packages.

``forge_kit`` is the chassis that more than one package needs (settings, the gRPC and HTTP kit,
events, the database, testing …); a module only one package uses belongs in that package. A
package is a distribution under ``libs/`` or ``services/``, its tests included; the repository's
own ``tests/``, ``load/``, ``deploy/`` and ``scripts/`` are not packages. A kit module that other
kit modules import is used by whoever uses those (``runtime`` through ``app``, ``localinfra``
through ``testing``), so the chassis' inner parts pass when what they serve is shared.

Imports are read from the source (AST), top-level and late ones alike, as git lists the files.

    python scripts/check_kit_users.py            # exit 1 naming every module with fewer than 2 users
    python scripts/check_kit_users.py --report   # every module and the packages that use it
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

from repofiles import repo_files

ROOT = Path(__file__).resolve().parent.parent
KIT = Path("libs/kit/src/forge_kit")
KIT_PACKAGE = "libs/kit"


def kit_modules(root: Path) -> list[str]:
    """The top-level modules and subpackages of ``forge_kit``."""
    names = []
    for path in sorted((root / KIT).iterdir()):
        if path.suffix == ".py" and path.stem != "__init__":
            names.append(path.stem)
        elif path.is_dir() and (path / "__init__.py").exists():
            names.append(path.name)
    return names


def package_of(path: str) -> str | None:
    """``libs/<x>`` or ``services/<x>`` for a file of that distribution, else None."""
    parts = Path(path).parts
    if len(parts) > 2 and parts[0] in ("libs", "services"):
        return f"{parts[0]}/{parts[1]}"
    return None


def kit_module_of(path: str) -> str | None:
    """The ``forge_kit`` module (or subpackage) a file of the kit's source is part of."""
    rel = Path(path)
    if rel.parts[: len(KIT.parts)] != KIT.parts or (
        len(rel.parts) == len(KIT.parts) + 1 and rel.stem == "__init__"
    ):
        return None
    inner = rel.parts[len(KIT.parts) :]
    return inner[0] if len(inner) > 1 else rel.stem


def imported_kit_modules(source: str) -> set[str]:
    """The ``forge_kit`` modules a file imports (``forge_kit.x…``, ``from forge_kit import x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "forge_kit":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("forge_kit."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("forge_kit."))
    return found


def users(root: Path) -> dict[str, set[str]]:
    """Each kit module and the packages that use it, directly or through other kit modules."""
    modules = kit_modules(root)
    direct: dict[str, set[str]] = defaultdict(set)
    inside: dict[str, set[str]] = defaultdict(set)  # kit module -> kit modules that import it
    for path in repo_files(root, "*.py"):
        package = package_of(path)
        if package is None:
            continue
        try:
            imported = imported_kit_modules((root / path).read_text(encoding="utf-8"))
        except SyntaxError:
            continue
        importer = kit_module_of(path)
        for name in imported & set(modules):
            if importer is not None:
                if importer != name:
                    inside[name].add(importer)
            elif package != KIT_PACKAGE:
                direct[name].add(package)
    resolved: dict[str, set[str]] = {}

    def resolve(name: str, seen: frozenset[str]) -> set[str]:
        if name in resolved:
            return resolved[name]
        found = set(direct[name])
        for importer in inside[name] - seen:
            found |= resolve(importer, seen | {name})
        if not seen:
            resolved[name] = found
        return found

    return {name: resolve(name, frozenset()) for name in modules}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    parser.add_argument("--report", action="store_true", help="list every module's users and exit 0")
    args = parser.parse_args(argv)
    found = users(args.root)
    if args.report:
        for name, packages in sorted(found.items(), key=lambda item: (len(item[1]), item[0])):
            print(f"{len(packages):3d} {name:22s} {', '.join(sorted(packages)) or '-'}")
        return 0
    lonely = {name: packages for name, packages in found.items() if len(packages) < 2}
    if lonely:
        print(
            "check_kit_users: forge_kit modules fewer than two packages use (move each to its user):",
            file=sys.stderr,
        )
        for name, packages in sorted(lonely.items()):
            print(
                f"  forge_kit.{name}: used by {', '.join(sorted(packages)) or 'no package'}", file=sys.stderr
            )
        return 1
    print(f"check_kit_users: {len(found)} forge_kit modules, each used by two packages or more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
