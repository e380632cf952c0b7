"""Shared test set-up: no hub access, deterministic torch, small thread pools."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(2)

if not torch.cuda.is_available():
    # Triton sets up its CPU interpreter only if TRITON_INTERPRET is set when triton is
    # first imported, and transformers imports triton: this must precede every test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")
