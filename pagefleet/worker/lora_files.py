"""A PEFT LoRA adapter directory's files, and the identity the prefix cache keys it by.

Torch-free: the ingress computes adapter identities (for its prefix hashes) without
loading the weights or importing torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def weights_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def adapter_identity(name: str, path: str | Path) -> str:
    """The identity `load_adapter(name, path, ...)` gives, from the weights file alone.

    For a router that hashes prompts the way the worker does: the same bytes
    under the same name always give the same id.
    """
    return f"{name}:{weights_hash((Path(path) / WEIGHTS_FILE).read_bytes())}"
