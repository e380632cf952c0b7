"""Where pagefleet keeps what it builds on a node: converted models, compiled kernels.

Imports the standard library only (`pagefleet.kernels` needs it without Ray or
transformers).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_DIR_ENV = "PAGEFLEET_CACHE_DIR"


def default_cache_root() -> Path:
    """`$PAGEFLEET_CACHE_DIR`, else `~/.cache/pagefleet`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagefleet"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if absent): one process builds a cache
    entry while the others that want it wait, then find it built."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
