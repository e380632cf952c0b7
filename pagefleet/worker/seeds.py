"""Seeds of seeded sampling: per completion, and per draw within a completion.

Torch-free: the ingress derives a resumed completion's seed without the engine.
"""

from __future__ import annotations


def derive_seed(base_seed: int, index: int) -> int:
    """Seed of completion `index`: distinct per index, stable across runs."""
    # Odd 64-bit multiplier (golden ratio) spreads indexes; keep inside torch's int64 seed range.
    return (base_seed + index * 0x9E3779B97F4A7C15) % (2**63)


_MASK64 = 2**64 - 1


def draw_seed(completion_seed: int, position: int) -> int:
    """Seed of a seeded completion's draw at output `position`: splitmix64 of both, so
    neighbouring positions and seeds give unrelated streams."""
    x = (completion_seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % (2**63)
