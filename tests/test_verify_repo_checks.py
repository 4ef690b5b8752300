"""The two checks of ``make verify`` that read the import graph: ``scripts/check_kit_users.py`` (no
forge_kit module only one package uses) and ``scripts/check_architecture.py`` (the import block of
docs/ARCHITECTURE.md is the code's). Each passes on this repository and fails on a scratch one
that breaks its rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True, timeout=120
    )


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    repo = tmp_path / "repo"
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    return repo


KIT = "libs/kit/src/forge_kit/"


def test_the_kit_gate_passes_here_and_names_a_module_only_one_package_uses(tmp_path: Path) -> None:
    assert _run("check_kit_users.py").returncode == 0
    repo = _repo(
        tmp_path,
        {
            KIT + "__init__.py": "",
            KIT + "shared.py": "from forge_kit import inner\n",
            KIT + "inner.py": "",  # used only by another kit module, which two packages use
            KIT + "lonely.py": "",
            "libs/training/src/forge_training/x.py": "from forge_kit import shared\nimport forge_kit.lonely\n",
            "services/eval/src/forge_eval/y.py": "def late():\n    from forge_kit.shared import thing\n",
            "libs/training/tests/test_y.py": "from forge_kit import lonely\n",  # the same package
            "tests/test_z.py": "from forge_kit import lonely\n",  # not a package
        },
    )
    result = _run("check_kit_users.py", "--root", str(repo))
    assert result.returncode == 1
    assert "forge_kit.lonely: used by libs/training\n" in result.stderr
    assert "shared" not in result.stderr and "inner" not in result.stderr
    (repo / "services/eval/src/forge_eval/z.py").write_text("from forge_kit import lonely\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    assert _run("check_kit_users.py", "--root", str(repo)).returncode == 0


def test_the_architecture_gate_passes_here_and_shows_an_undocumented_import(tmp_path: Path) -> None:
    assert _run("check_architecture.py").returncode == 0
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    repo = _repo(
        tmp_path,
        {
            "docs/ARCHITECTURE.md": doc,
            KIT + "__init__.py": "",
            "services/eval/src/forge_eval/a.py": "from typing import TYPE_CHECKING\nimport forge_kit\n"
            "if TYPE_CHECKING:\n    import forge_scheduler\n",
            "services/scheduler/src/forge_scheduler/b.py": "def late():\n    import forge_kit.db\n",
        },
    )
    assert (
        _run("check_architecture.py", "--root", str(repo)).returncode == 1
    )  # the real block: other packages
    assert _run("check_architecture.py", "--root", str(repo), "--write").returncode == 0
    written = (repo / "docs/ARCHITECTURE.md").read_text()
    assert "forge_eval -> forge_kit\n" in written  # the TYPE_CHECKING import is no edge
    assert "forge_scheduler -> forge_kit (late)\n" in written
    assert _run("check_architecture.py", "--root", str(repo)).returncode == 0

    (repo / "services/eval/src/forge_eval/c.py").write_text("import forge_scheduler.service\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    result = _run("check_architecture.py", "--root", str(repo))
    assert result.returncode == 1
    assert "-forge_eval -> forge_kit" in result.stderr
    assert "+forge_eval -> forge_kit, forge_scheduler" in result.stderr
