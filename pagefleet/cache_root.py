"""Where pagefleet keeps what it builds on a node: converted models, compiled kernels.

Imports the standard library only (`pagefleet.kernels` needs it without Ray or
transformers).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "PAGEFLEET_CACHE_DIR"


def default_cache_root() -> Path:
    """`$PAGEFLEET_CACHE_DIR`, else `~/.cache/pagefleet`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagefleet"
