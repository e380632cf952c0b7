"""Byte sizes: the one grammar of every byte field, in YAML, on the command line and in `plan`.

"512MiB", "8GiB" and "8G" are binary (bare K/M/G/T as in most memory flags,
`--memory 4G`), "2GB" and "80GB" decimal, "4096" and the int 4096 plain bytes.
`ByteSize` is that grammar as a field type: a config field annotated with it
reads any of those spellings.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Bytes in an int or a size such as "4GiB", "512MiB", "1.5GB", "8G" (binary) or "1000000"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            "expected a byte size (a number with an optional unit: B, K, M, G, T, KB, MB, GB, "
            f"TB, KiB, MiB, GiB, TiB), cannot parse size {value!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """A size in the largest binary unit that keeps it >= 1, e.g. "4.00 GiB"."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _to_bytes(value: Any) -> Any:
    # Anything but an int or a string is left to the int check, which names its type.
    return parse_bytes(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else value


ByteSize = Annotated[int, BeforeValidator(_to_bytes)]
"""An int field that also reads "512MiB", "8G", "2GB" (see `parse_bytes`)."""
