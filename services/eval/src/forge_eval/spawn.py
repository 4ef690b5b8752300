"""Child processes that die with their parent or run under resource limits, with no Python code
of the parent's between ``fork`` and ``exec``.

Why not ``subprocess``'s ``preexec_fn``: it runs Python in the child of a multi-threaded process
(gRPC's poller threads, torch's pools) and makes CPython fork() instead of vfork(), so every
``pthread_atfork`` handler runs in the child too — gRPC's re-creates its event engine there. The
eval service's model-server children died that way now and then before exec (SIGSEGV with no
output, or SIGABRT after gRPC's ``epoll_wait error: Bad file descriptor``). Instead the parent
runs :func:`command`'s argument vector: a fresh interpreter of this module sets the limits and the
parent-death signal on itself and then execs the real command. Both survive ``execve``.

``python -m forge_eval.spawn [--parent PID] [--rlimit NAME=SOFT:HARD ...] -- COMMAND ...``
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import sys
from collections.abc import Mapping, Sequence

_PR_SET_PDEATHSIG = 1

#: Exit status when the parent had already gone before the child could tie itself to it.
ORPHANED_EXIT = 125


def command(
    argv: Sequence[str],
    *,
    die_with_parent: bool = False,
    rlimits: Mapping[str, tuple[int, int]] | None = None,
) -> list[str]:
    """The argument vector that runs ``argv`` so it gets SIGTERM when this process exits
    (``die_with_parent``, Linux only) and under ``rlimits`` (``{"AS": (soft, hard)}``, names of
    :mod:`resource`'s ``RLIMIT_*`` without the prefix)."""
    if not argv:
        raise ValueError("argv is empty")
    args = [sys.executable, "-m", "forge_eval.spawn"]
    if die_with_parent and sys.platform.startswith("linux"):
        args += ["--parent", str(os.getpid())]
    for name, (soft, hard) in (rlimits or {}).items():
        _resource(name)
        args += ["--rlimit", f"{name}={soft}:{hard}"]
    return [*args, "--", *argv]


def _resource(name: str) -> int:
    value = getattr(resource, f"RLIMIT_{name.upper()}", None)
    if not isinstance(value, int):
        raise ValueError(f"unknown resource limit {name!r}")
    return value


def _limit(text: str) -> tuple[int, int, int]:
    name, _, values = text.partition("=")
    soft, _, hard = values.partition(":")
    return _resource(name), int(soft), int(hard or soft)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forge_eval.spawn", description=__doc__)
    parser.add_argument("--parent", type=int, help="exit with SIGTERM when this process does")
    parser.add_argument("--rlimit", type=_limit, action="append", default=[], metavar="NAME=SOFT:HARD")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not program:
        parser.error("no command given")
    for res, soft, hard in args.rlimit:
        resource.setrlimit(res, (soft, hard))
    if args.parent is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent may have exited between our fork and the prctl: then nobody would signal us.
        if os.getppid() != args.parent:
            sys.exit(ORPHANED_EXIT)
    sys.stdout.flush()
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
