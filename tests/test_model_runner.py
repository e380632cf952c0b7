"""The model runner reproduces HF `generate` token for token on the paged KV cache.

The runner is driven directly, the way an engine would drive it: sequences
packed into one step, block tables made by hand (shuffled, non-contiguous) or
by the real BlockPool/BlockTable, prefill chunked across steps. Everything
runs in float64, where "identical" is the claim.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
# Triton imported without the interpreter cannot run kernels on CPU later in this process.
TRITON_IMPORTED_UNINTERPRETED = "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET")
if not ON_CUDA:
    # Without a GPU the Triton kernels run in the interpreter, which must be on when triton
    # is first imported (its own jitted helpers are decorated then); importing transformers'
    # models imports triton, so this goes first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_models import (  # noqa: E402
    ARCHS,
    build_tiny_hf_model,
    check_diverse,
    hf_greedy,
    load_hf_reference,
    next_token_logits,
    prompt_ids,
    top2_gap,
)
from transformers import GPT2Config, PreTrainedModel  # noqa: E402

from pagefleet.worker.block_pool import BlockPool  # noqa: E402
from pagefleet.worker.block_table import BlockTable  # noqa: E402
from pagefleet.worker.kv_cache import KVCache, ModelShape  # noqa: E402
from pagefleet.worker.model_runner import (  # noqa: E402
    ModelRunner,
    StepBatch,
    UnsupportedModelError,
)

BLOCK_SIZE = 8
NUM_BLOCKS = 96
# Around block boundaries (8, 16) and one either side, plus a short one.
PROMPT_LENS = (3, 7, 8, 9, 15, 16, 17)
MAX_NEW = 10


class ShuffledSlots:
    """Each sequence owns a fixed, shuffled, non-contiguous run of block ids."""

    def __init__(self, num_seqs: int, blocks_per_seq: int, seed: int = 0) -> None:
        perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        assert num_seqs * blocks_per_seq <= NUM_BLOCKS
        self.tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(num_seqs)]

    def reserve(self, seq: int, start: int, n: int) -> list[int]:
        table = self.tables[seq]
        return [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + n)
        ]

    def block_table(self, seq: int, num_tokens: int) -> list[int]:
        return self.tables[seq][: -(-num_tokens // BLOCK_SIZE)]


class PoolSlots:
    """Slots from the real BlockPool / BlockTable, allocated as sequences grow."""

    def __init__(self, num_seqs: int) -> None:
        self.pool = BlockPool(NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=False)
        self.tables = [BlockTable(self.pool) for _ in range(num_seqs)]

    def reserve(self, seq: int, start: int, n: int) -> list[int]:
        assert self.tables[seq].num_tokens == start
        return self.tables[seq].append_slots(n).slots

    def block_table(self, seq: int, num_tokens: int) -> list[int]:
        return list(self.tables[seq].block_ids)


@dataclass
class Seq:
    tokens: list[int]
    computed: int = 0
    generated: int = 0


def run_greedy(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    slots: ShuffledSlots | PoolSlots,
    chunk: int | None = None,
    admit_step: Sequence[int] | None = None,
    on_batch: Callable[[StepBatch], None] | None = None,
) -> list[list[int]]:
    """Greedy decoding through `runner.execute`, one packed step per loop.

    `chunk` caps the new tokens a sequence feeds per step (chunked prefill);
    `admit_step[i]` is the step at which sequence i joins (staggered arrivals).
    """
    seqs = [Seq(list(p)) for p in prompts]
    admit = list(admit_step) if admit_step is not None else [0] * len(seqs)
    step = 0
    while any(s.generated < max_new for s in seqs):
        batch = StepBatch([], [], [], [0], [], [])
        members: list[int] = []
        for i, s in enumerate(seqs):
            if admit[i] > step or s.generated >= max_new:
                continue
            n = len(s.tokens) - s.computed
            if chunk is not None:
                n = min(n, chunk)
            batch.input_ids += s.tokens[s.computed : s.computed + n]
            batch.positions += list(range(s.computed, s.computed + n))
            batch.slot_mapping += slots.reserve(i, s.computed, n)
            s.computed += n
            batch.query_start_loc.append(batch.query_start_loc[-1] + n)
            batch.context_lens.append(s.computed)
            batch.block_tables.append(slots.block_table(i, s.computed))
            members.append(i)
        step += 1
        if not members:
            continue
        if on_batch is not None:
            on_batch(batch)
        next_tokens = runner.execute(batch).argmax(dim=-1).tolist()
        for i, token in zip(members, next_tokens, strict=True):
            s = seqs[i]
            if s.computed == len(s.tokens):  # a mid-prefill chunk's logits are not a sample
                s.tokens.append(token)
                s.generated += 1
    return [s.tokens[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


@dataclass
class ArchSetup:
    arch: str
    model_dir: Path
    runner: ModelRunner
    reference: PreTrainedModel
    prompts: list[list[int]]
    expected: list[list[int]]


def _bind_fresh_cache(runner: ModelRunner) -> None:
    runner.bind_kv_cache(KVCache(runner.model_shape, NUM_BLOCKS, BLOCK_SIZE))


@pytest.fixture(scope="module", params=ARCHS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ArchSetup:
    arch = request.param
    model_dir = build_tiny_hf_model(arch, tmp_path_factory.mktemp(arch))
    reference = load_hf_reference(model_dir)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    check_diverse(expected, min_distinct=40)
    runner = ModelRunner(model_dir, dtype="float64")
    return ArchSetup(arch, model_dir, runner, reference, prompts, expected)


def test_packed_prefill_and_decode_on_shuffled_blocks_match_hf_generate(setup: ArchSetup) -> None:
    _bind_fresh_cache(setup.runner)
    slots = ShuffledSlots(len(setup.prompts), blocks_per_seq=4)
    got = run_greedy(setup.runner, setup.prompts, MAX_NEW, slots)
    assert got == setup.expected


def test_real_block_tables_with_staggered_arrivals_match_hf_generate(setup: ArchSetup) -> None:
    _bind_fresh_cache(setup.runner)
    slots = PoolSlots(len(setup.prompts))
    admit = [0, 2, 0, 5, 1, 3, 0]  # prefills land in the same steps as other sequences' decodes
    got = run_greedy(setup.runner, setup.prompts, MAX_NEW, slots, admit_step=admit)
    assert got == setup.expected
    slots.pool.check_integrity()


def test_chunked_prefill_matches_hf_generate(setup: ArchSetup) -> None:
    _bind_fresh_cache(setup.runner)
    slots = ShuffledSlots(len(setup.prompts), blocks_per_seq=4, seed=1)
    batches: list[StepBatch] = []
    got = run_greedy(setup.runner, setup.prompts, MAX_NEW, slots, chunk=5, on_batch=batches.append)
    assert got == setup.expected
    # The 17-token prompt really was split: its first step fed 5 of 17 tokens.
    assert batches[0].context_lens[PROMPT_LENS.index(17)] == 5


def test_execute_returns_one_float64_logit_row_per_sequence(setup: ArchSetup) -> None:
    _bind_fresh_cache(setup.runner)
    slots = ShuffledSlots(2, blocks_per_seq=4, seed=2)
    batch = StepBatch(
        input_ids=setup.prompts[1] + setup.prompts[2],  # 7 and 8 tokens
        positions=list(range(7)) + list(range(8)),
        slot_mapping=slots.reserve(0, 0, 7) + slots.reserve(1, 0, 8),
        query_start_loc=[0, 7, 15],
        context_lens=[7, 8],
        block_tables=[slots.block_table(0, 7), slots.block_table(1, 8)],
    )
    logits = setup.runner.execute(batch)
    assert logits.shape == (2, setup.runner.vocab_size)
    assert logits.dtype == torch.float64
    expected_first = setup.reference(torch.tensor([setup.prompts[1]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected_first, rtol=1e-9, atol=1e-9)


def _window_expectations(
    tmp: Path, arch: str, **overrides: Any
) -> tuple[ModelRunner, list[list[int]], list[list[int]], list[list[int]]]:
    windowed = build_tiny_hf_model(arch, tmp / "windowed", **overrides)
    full = build_tiny_hf_model(arch, tmp / "full")  # same seed: same weights, no window
    prompts = [prompt_ids(n, seed=100 + n) for n in (9, 17)]
    expected = [hf_greedy(load_hf_reference(windowed), p, 12) for p in prompts]
    without_window = [hf_greedy(load_hf_reference(full), p, 12) for p in prompts]
    return ModelRunner(windowed, dtype="float64"), prompts, expected, without_window


def test_mistral_sliding_window_matches_hf_generate(tmp_path: Path) -> None:
    runner, prompts, expected, without_window = _window_expectations(
        tmp_path, "mistral", sliding_window=6
    )
    assert expected != without_window, "the window must change the result, else this proves nothing"
    assert runner.sliding_windows == (6, 6)
    _bind_fresh_cache(runner)
    got = run_greedy(runner, prompts, 12, ShuffledSlots(2, blocks_per_seq=6))
    assert got == expected


def test_qwen2_mixed_full_and_sliding_layers_match_hf_generate(tmp_path: Path) -> None:
    runner, prompts, expected, without_window = _window_expectations(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1
    )
    assert expected != without_window, "the window must change the result, else this proves nothing"
    assert runner.sliding_windows == (None, 5)
    _bind_fresh_cache(runner)
    got = run_greedy(runner, prompts, 12, ShuffledSlots(2, blocks_per_seq=6), chunk=4)
    assert got == expected


# Config options the three families' checkpoints use beyond the defaults: each changes the
# forward (RoPE scaling, biases, a tied head, another activation), and the runner's own
# model must follow transformers in each.
CONFIG_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 500.0}}),
    "llama-rope-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-tied-gelu": ("llama", {"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"}),
    "qwen2-rope-yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                      "rope_theta": 1000.0}}),
    "mistral-no-head-dim": ("mistral", {"head_dim": None}),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(CONFIG_VARIANTS))
def test_config_variants_match_hf_generate_and_read_as_autoconfig(
    variant: str, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    from pagefleet.worker.model_config import read_model_config

    arch, overrides = CONFIG_VARIANTS[variant]
    model_dir = build_tiny_hf_model(arch, tmp_path, **overrides)
    hf = AutoConfig.from_pretrained(model_dir)
    ours = read_model_config(model_dir)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "hidden_act",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "rope_parameters", "eos_token_id"):  # fmt: skip
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    reference = load_hf_reference(model_dir)
    prompts = [prompt_ids(n, seed=n) for n in PROMPT_LENS]
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    runner = ModelRunner(model_dir, dtype="float64")
    _bind_fresh_cache(runner)
    assert run_greedy(runner, prompts, MAX_NEW, ShuffledSlots(len(prompts), 4), chunk=5) == expected


def test_a_sharded_checkpoint_loads_as_the_single_file_one(setup: ArchSetup, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "sharded"
    shutil.copytree(setup.model_dir, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, model_dir / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    runner = ModelRunner(model_dir, dtype="float64")
    _bind_fresh_cache(runner)
    got = run_greedy(runner, setup.prompts, MAX_NEW, ShuffledSlots(len(setup.prompts), 4))
    assert got == setup.expected


def test_a_checkpoint_that_misses_or_adds_a_tensor_is_refused_naming_it(
    setup: ArchSetup, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    from pagefleet.worker.model_files import ModelFileError

    tensors = load_file(setup.model_dir / "model.safetensors")
    for name, change in (("lacks", "model.norm.weight"), ("adds", "model.extra.weight")):
        model_dir = tmp_path / name
        shutil.copytree(setup.model_dir, model_dir)
        edited = dict(tensors)
        if change in edited:
            del edited[change]
        else:
            edited[change] = torch.zeros(2)
        save_file(edited, model_dir / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelFileError, match=change.replace(".", r"\.")):
            ModelRunner(model_dir, dtype="float64")


def _write_config(tmp: Path, config: dict[str, object]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"])
    model_dir = _write_config(tmp_path, config.to_dict())
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelRunner(model_dir)


def test_batch_dependent_rope_is_refused(tmp_path: Path) -> None:
    from hf_models import tiny_hf_config

    config = tiny_hf_config(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelRunner(_write_config(tmp_path, config.to_dict()))


def test_mistral_with_mixed_layer_types_is_refused(tmp_path: Path) -> None:
    from hf_models import tiny_hf_config

    config = tiny_hf_config("mistral", sliding_window=8).to_dict()
    config["layer_types"] = ["sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match=r"layer_types|ministral"):
        ModelRunner(_write_config(tmp_path, config))


def test_config_without_architectures_is_accepted_by_model_type(
    setup: ArchSetup, tmp_path: Path
) -> None:
    model_dir = tmp_path / "copy"
    shutil.copytree(setup.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    del config["architectures"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert ModelRunner(model_dir, dtype="float64").sliding_windows == (None, None)


def test_unknown_model_type_is_refused(tmp_path: Path) -> None:
    model_dir = _write_config(tmp_path, {"model_type": "no-such-arch", "architectures": ["X"]})
    with pytest.raises(UnsupportedModelError, match="no-such-arch"):
        ModelRunner(model_dir)


def test_missing_model_directory_is_refused_without_download(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        ModelRunner(tmp_path / "no-such-model")


def test_execute_needs_a_bound_cache_of_the_model_shape(setup: ArchSetup) -> None:
    fresh = ModelRunner(setup.model_dir, dtype="float64")
    batch = StepBatch([5], [0], [0], [0, 1], [1], [[0]])
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        fresh.execute(batch)
    wrong = ModelShape(fresh.model_shape.num_layers + 1, 2, 16, torch.float64)
    with pytest.raises(ValueError, match="does not match"):
        fresh.bind_kv_cache(KVCache(wrong, 4, BLOCK_SIZE))


def test_float32_runner_returns_float32_logits(setup: ArchSetup) -> None:
    runner = ModelRunner(setup.model_dir, dtype="float32")
    runner.bind_kv_cache(KVCache(runner.model_shape, 4, BLOCK_SIZE))
    logits = runner.execute(StepBatch([0, 5, 9], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]]))
    assert logits.dtype == torch.float32 and logits.shape == (1, runner.vocab_size)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float16", 0.02), ("bfloat16", 0.1)])
def test_half_precision_logits_track_hf(tmp_path: Path, dtype: str, tolerance: float) -> None:
    model_dir = build_tiny_hf_model("llama", tmp_path, dtype=torch.float32)
    runner = ModelRunner(model_dir, dtype=dtype)
    assert runner.model_shape.dtype == getattr(torch, dtype)
    runner.bind_kv_cache(KVCache(runner.model_shape, 4, BLOCK_SIZE))
    prompt = prompt_ids(9, seed=9)
    batch = StepBatch(prompt, list(range(9)), [8 + i for i in range(9)], [0, 9], [9], [[1, 2]])
    logits = runner.execute(batch)[0]
    expected = load_hf_reference(model_dir, dtype=getattr(torch, dtype))
    want = next_token_logits(expected, prompt).float()
    assert logits.dtype == torch.float32
    assert (logits - want).abs().max().item() < tolerance


def test_cpu_profile_estimate_grows_with_the_token_budget(setup: ArchSetup) -> None:
    small = setup.runner.profile_peak_bytes(256)
    large = setup.runner.profile_peak_bytes(512)
    assert 0 < small < large


def test_inconsistent_step_batch_is_rejected(setup: ArchSetup) -> None:
    _bind_fresh_cache(setup.runner)
    bad = StepBatch([1, 2], [0, 1], [0, 1], [0, 2], [1], [[0]])  # 2 new tokens, context 1
    with pytest.raises(ValueError, match="context_len"):
        setup.runner.execute(bad)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_through_the_runner_match_hf_generate_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runner's calling convention (layouts, strides, index dtypes) against the Triton
    # kernels: on the GPU when there is one, else under the Triton interpreter on CPU.
    if not ON_CUDA and TRITON_IMPORTED_UNINTERPRETED:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set; tests/conftest.py must set "
            "it before any test module imports transformers"
        )
    monkeypatch.setenv("PAGEFLEET_ATTENTION", "triton")
    device = "cuda" if ON_CUDA else "cpu"
    model_dir = build_tiny_hf_model("qwen2", tmp_path, dtype=torch.float32)
    reference = load_hf_reference(model_dir, dtype=torch.float32)
    prompts = [prompt_ids(n, seed=200 + n) for n in (7, 9)]
    expected = [hf_greedy(reference, p, 4) for p in prompts]
    runner = ModelRunner(model_dir, dtype="float32", device=device)
    runner.bind_kv_cache(KVCache(runner.model_shape, NUM_BLOCKS, BLOCK_SIZE, device))
    got = run_greedy(runner, prompts, 4, ShuffledSlots(2, blocks_per_seq=4))
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        if have != want:  # float32: a divergence is acceptable only at a near-tie
            first = next(i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b)
            gap = top2_gap(reference, prompt + want[:first])
            assert gap < 1e-4, f"diverged at token {first} with a top-2 logit gap of {gap}"


def test_building_an_engine_loads_neither_torch_dynamo_nor_sympy() -> None:
    """A worker builds its model from the meta device without torch's Python reference
    ops (a meta `arange` or `empty_like`, a random init of a fused projection): their
    first use imports torch._dynamo and sympy, over two CPU-seconds at every worker
    start. A fresh interpreter, since this one may have them loaded already."""
    import subprocess

    code = (
        "import sys\n"
        "from pagefleet.worker.engine import LLMEngine\n"
        "from pagefleet.worker.config import EngineConfig\n"
        "LLMEngine(EngineConfig(model='tiny', device='cpu'))\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
