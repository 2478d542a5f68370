"""Run the fp8rl command line in this process and SIGKILL it at a chosen point.

    python killpoint.py MODULE:ATTR N before|after -- fp8rl CLI arguments

ATTR is a function or `Class.method` of MODULE, looked up at call time by
its callers. The process kills itself (SIGKILL: no cleanup, no finally
blocks, exactly like `kill -9` or a lost machine) just before or just after
the N-th call; under torchrun, only on rank KILLPOINT_RANK when that is set.
Used by tests/test_crash_safety.py and tests/test_distributed.py; no hook in
fp8rl itself.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import Any


def install(target: str, nth: int, when: str) -> None:
    module_name, attr = target.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls == nth and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapper)


if __name__ == "__main__":
    split = sys.argv.index("--")
    target, nth, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if when not in ("before", "after"):
        raise SystemExit(f"when must be before or after, got {when!r}")
    # Under torchrun, KILLPOINT_RANK=r kills only rank r (a lost rank of a data-parallel run).
    if os.environ.get("KILLPOINT_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"):
        install(target, nth, when)
    from fp8rl.cli import main

    sys.exit(main(sys.argv[split + 1 :]))
