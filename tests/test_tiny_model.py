"""The built-in tiny model builds offline, deterministically, once, and writes diverse text."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hf_models import check_diverse, hf_greedy, load_hf_reference
from transformers import AutoTokenizer

import pagefleet
from pagefleet.cache_root import CACHE_DIR_ENV
from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.model_runner import ModelRunner, StepBatch
from pagefleet.worker.tiny_model import (
    BOS_ID,
    EOS_ID,
    TINY_VOCAB_SIZE,
    ensure_tiny_model,
    tiny_model_config,
    tiny_model_dir_name,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_a_build_in_a_fresh_process_is_byte_identical(tmp_path: Path, tiny_dir: Path) -> None:
    # A separate interpreter retrains the tokenizer and redraws the weights from scratch,
    # as every Ray worker on a fresh machine would.
    repo_root = str(Path(pagefleet.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]),
    }
    code = "import sys; from pathlib import Path; from pagefleet.worker.tiny_model import save_tiny_model; save_tiny_model(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=300)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_second_call_reuses_the_built_directory(tiny_dir: Path) -> None:
    weights = tiny_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_tiny_model(tiny_dir.parent) == tiny_dir
    assert weights.stat().st_mtime_ns == before


def test_racing_builders_share_one_complete_directory(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == tmp_path / tiny_model_dir_name()
    assert (results[0] / "model.safetensors").is_file()
    # No staging directory is left behind by the loser.
    assert [p.name for p in tmp_path.iterdir()] == [tiny_model_dir_name()]


def test_cache_dir_env_variable_picks_the_cache_root(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_dir.rename(tmp_path / tiny_dir.name)  # reuse the build instead of rebuilding
    try:
        monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
        assert ensure_tiny_model() == tmp_path / tiny_model_dir_name()
    finally:
        (tmp_path / tiny_dir.name).rename(tiny_dir)


def test_config_is_available_without_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    config = tiny_model_config()
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        4,
        2,
        TINY_VOCAB_SIZE,
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "text",
    [
        "The harbor at low tide.",
        "  leading spaces, tabs\tand\nnewlines\n",
        "Ünïcode, 日本語 and emoji 🙂 round-trip byte for byte",
        "def add(a, b):\n    return a + b",
    ],
)
def test_tokenizer_round_trips_text(tiny_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer(text).input_ids
    assert ids[0] == BOS_ID
    assert max(ids) < TINY_VOCAB_SIZE
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_knows_its_special_tokens(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    assert tokenizer.pad_token_id is not None
    assert len(tokenizer) == TINY_VOCAB_SIZE


def test_greedy_text_is_diverse(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = load_hf_reference(tiny_dir, dtype=torch.float32)
    out = hf_greedy(model, tokenizer("The river begins").input_ids, 32)
    check_diverse([out], min_distinct=20)


def test_runner_on_tiny_reproduces_hf_generate(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompt = tokenizer("On Saturdays the square fills with stalls.").input_ids
    expected = hf_greedy(load_hf_reference(tiny_dir), prompt, 8)
    runner = ModelRunner(tiny_dir, dtype="float64")
    runner.bind_kv_cache(KVCache(runner.model_shape, 8, 16))
    assert runner.eos_token_ids == {EOS_ID}
    tokens = list(prompt)
    table = [5, 2]  # non-contiguous, 32 slots
    for _ in range(8):
        start = 0 if len(tokens) == len(prompt) else len(tokens) - 1
        new = list(range(start, len(tokens)))
        batch = StepBatch(
            input_ids=tokens[start:],
            positions=new,
            slot_mapping=[table[p // 16] * 16 + p % 16 for p in new],
            query_start_loc=[0, len(new)],
            context_lens=[len(tokens)],
            block_tables=[table],
        )
        tokens.append(int(runner.execute(batch).argmax(-1)[0]))
    assert tokens[len(prompt) :] == expected
