"""Progress bars for long CLI work (model conversion, benchmarks).

Shown only when stderr is a terminal and `TQDM_DISABLE` is unset
(`pagefleet.cli` sets it when stderr is redirected, so logs stay plain).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def enabled() -> bool:
    """Whether bars are drawn: stderr is a terminal and nobody turned them off."""
    return sys.stderr.isatty() and not os.environ.get("TQDM_DISABLE")


def bar(*, desc: str, total: int | None = None, unit: str = "it") -> Any:
    """A tqdm bar on stderr (a context manager with `update(n)`); draws nothing unless `enabled()`."""
    from tqdm import tqdm

    return tqdm(
        desc=desc, total=total, unit=unit, file=sys.stderr, disable=not enabled(),
        leave=False, dynamic_ncols=True,
    )


@contextlib.contextmanager
def phases(desc: str, names: Sequence[str]) -> Iterator[Callable[[str], None]]:
    """A bar of named phases: call the yielded function with each phase's name as it starts."""
    with bar(desc=desc, total=len(names), unit="step") as steps:
        started = False

        def enter(name: str) -> None:
            nonlocal started
            if started:
                steps.update(1)
            started = True
            steps.set_postfix_str(name)

        yield enter
        if started:
            steps.update(1)
