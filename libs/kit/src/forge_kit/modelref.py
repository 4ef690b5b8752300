"""A model version's identity: a :class:`ModelRef` (name, version), written ``name:version``.

The same identity names a checkpoint in eval's registry, in the ``ModelPromoted`` event that moves
an alias, in the gateway's alias table and routing, in the name a model server serves it under,
and in the ``x-forge-model`` header that says which version answered. It is parsed and formatted
here only, so every service agrees on the grammar:

- ``name``: 1-128 characters, letters, digits, ``.``, ``_`` or ``-``, starting with a letter or
  digit (a model server uses it as a folder name, so no ``/`` and no ``..`` on its own);
- ``version``: empty (unpinned: whatever the holder of the name serves) or 1-64 characters of the
  same alphabet, starting with a letter or digit;
- text form: ``name`` when the version is empty, else ``name:version`` (one ``:``).

Anything else is refused with a :class:`ValueError` that quotes the offending input (shortened).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

NAME_MAX = 128
VERSION_MAX = 64
SEPARATOR = ":"
#: The longest text :meth:`ModelRef.parse` looks at: ``name:version`` at their limits.
TEXT_MAX = NAME_MAX + len(SEPARATOR) + VERSION_MAX

_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}")
_VERSION = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{VERSION_MAX - 1}}}")
_ALPHABET = "letters, digits, '.', '_' or '-', starting with a letter or digit"


class NameAndVersion(Protocol):
    """Anything with ``name`` and ``version`` strings (``forge.common.v1.ModelRef`` messages)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...


def _shown(text: str, limit: int = 80) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def label(name: str, version: str) -> str:
    """How a model version is written: ``name:version``, or ``name`` when no version is named. Not
    checked (for messages, logs and reports of what a record or message holds); a
    :class:`ModelRef` writes itself the same way."""
    return f"{name}{SEPARATOR}{version}" if version else name


def check_name(name: str) -> str:
    """``name`` when it is a valid model name, else a :class:`ValueError` naming it."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = _shown(name) if isinstance(name, str) else type(name).__name__
        raise ValueError(f"invalid model name {shown}: must be 1 to at most {NAME_MAX} {_ALPHABET}")
    return name


def check_version(version: str) -> str:
    """``version`` when it is empty or a valid version, else a :class:`ValueError` naming it."""
    if not isinstance(version, str) or (version and not _VERSION.fullmatch(version)):
        shown = _shown(version) if isinstance(version, str) else type(version).__name__
        raise ValueError(f"invalid model version {shown}: must be empty or at most {VERSION_MAX} {_ALPHABET}")
    return version


@dataclass(frozen=True, order=True)
class ModelRef:
    """A model version: ``name`` and ``version`` (``""``: not pinned). Valid once constructed."""

    name: str
    version: str = ""

    def __post_init__(self) -> None:
        check_name(self.name)
        check_version(self.version)

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        """``name`` or ``name:version`` → a ModelRef; a :class:`ValueError` quoting ``text`` otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"a model reference must be a string, got {type(text).__name__}")
        if len(text) > TEXT_MAX:
            raise ValueError(
                f"invalid model reference {_shown(text)}: longer than {TEXT_MAX} characters (name:version)"
            )
        name, separator, version = text.partition(SEPARATOR)
        if separator and not version:
            raise ValueError(f"invalid model reference {_shown(text)}: nothing after ':' (name:version)")
        try:
            return cls(name, version)
        except ValueError as exc:
            raise ValueError(f"invalid model reference {_shown(text)}: {exc}") from None

    @classmethod
    def parse_optional(cls, text: str) -> ModelRef | None:
        """:meth:`parse`, with ``""`` meaning none (an optional reference, a model's parent)."""
        return cls.parse(text) if text else None

    @classmethod
    def of(cls, message: NameAndVersion) -> ModelRef:
        """From anything with ``name`` and ``version`` (a ``forge.common.v1.ModelRef`` message)."""
        return cls(message.name, message.version)

    def __str__(self) -> str:
        return label(self.name, self.version)

    @property
    def pinned(self) -> bool:
        """Whether a version is named (otherwise whatever version the holder of the name serves)."""
        return bool(self.version)

    def with_version(self, version: str) -> ModelRef:
        """The same name at ``version``."""
        return ModelRef(self.name, version)

    def matches(self, served: ModelRef) -> bool:
        """Whether a request for this reference may be answered by ``served``: the same name, and
        the same version unless either leaves it open."""
        return self.name == served.name and (
            not self.version or not served.version or self.version == served.version
        )
