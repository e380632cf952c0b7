"""Shared test set-up: no hub access, deterministic torch, small thread pools."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Every Ray the tests start or join runs without token auth: a process that joined one
# cluster without a token keeps that mode in Ray's config, and a local Ray it starts
# later (with a token, Ray's default) would refuse it (InvalidAuthToken).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(2)

if not torch.cuda.is_available():
    # Triton sets up its CPU interpreter only if TRITON_INTERPRET is set when triton is
    # first imported, and transformers imports triton: this must precede every test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")
