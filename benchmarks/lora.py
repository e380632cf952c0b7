"""Multi-LoRA throughput: a mixed batch over 1, 4 and 16 adapters against the base model
alone (the LoRA overhead) and against HF + PEFT switching adapters per request.

Model: `tiny` (default) or `--model smollm2-135m-instruct`, float32, CPU.
Adapters: random PEFT LoRA adapters of rank 8 on q/k/v/o and gate/up/down,
built offline (`tests/lora_adapters.py`). Workload: `--requests` prompts
(default 32) of 48 random tokens, 32 greedy tokens each (EOS ignored), all
submitted in one `LLM.generate` call; request `i` uses adapter `i mod k`.
Each engine row is one `LLM` with `max_loras` = the adapters it serves (so
no slot is reloaded mid-run). HF + PEFT: one `PeftModel` holding 4 adapters,
`set_adapter` then `generate` (its own cache) per request, one at a time,
the way an unbatched adapter server runs. Printed: output tokens/s per row
and the ratios; how many of the 4-adapter run's outputs equal HF + PEFT's.
Then what the router's `w_adapter_load` stands for: the time to load an
adapter into a slot (one slot, two adapters alternating: each load evicts
the other; median of 20) in prefilled blocks (a 48-token prompt's prefill,
prefix caching off, median of 5, per block of 16 tokens).
`--smoke`: 8 requests of 16 tokens, 4 new tokens, adapters 1 and 4 only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _engine_bench as common

# The adapters come from the tests' builder: one recipe for tests and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from lora_adapters import build_lora_adapter

PROMPT_LEN, MAX_TOKENS = 48, 32
HF_PEFT_ADAPTERS = 4


def run_engine(
    model: str, adapters: dict[str, Path], prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    from pagefleet import LLM, SamplingParams

    llm = LLM(model, lora_adapters=adapters, max_loras=max(1, len(adapters)),
              enable_prefix_caching=False)
    names: list[str | None] = [None] * len(prompts)
    if adapters:
        ordered = sorted(adapters)
        names = [ordered[i % len(ordered)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), adapter=names[:1])  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, adapter=names)
    seconds = time.perf_counter() - start
    llm.check_integrity()
    return {
        "tokens_per_s": len(prompts) * max_tokens / seconds,
        "answers": [o.token_ids for o in outs],
        "names": names,
    }


def measure_load_cost(model: str, adapters: dict[str, Path], prompts: list[list[int]]) -> dict[str, float]:
    """Seconds to load an adapter into a slot, and to prefill one block, on one engine."""
    from pagefleet import LLM, SamplingParams

    two = dict(sorted(adapters.items())[:2])
    llm = LLM(model, lora_adapters=two, max_loras=1, enable_prefix_caching=False)
    lora = llm.engine.lora
    assert lora is not None
    names = sorted(two)
    loads = []
    for i in range(20):
        start = time.perf_counter()
        assert lora.acquire(names[i % 2], ())
        loads.append(time.perf_counter() - start)
    assert lora.evictions >= 19
    block = llm.engine.config.block_size
    prefills = []
    for prompt in prompts[:5]:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        prefills.append((time.perf_counter() - start) / (len(prompt) / block))
    load_s, block_s = statistics.median(loads), statistics.median(prefills)
    return {"load_s": load_s, "block_s": block_s, "blocks": load_s / block_s}


def run_hf_peft(
    model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str | None],
    max_tokens: int,
) -> dict[str, Any]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # No EOS at all, as the engine's ignore_eos: `generate` fills an unset eos_token_id
    # from the model's generation config, and min_new_tokens would mask EOS instead
    # (another token than the greedy one).
    base.generation_config.eos_token_id = None
    ordered = sorted(adapters)
    peft: Any = PeftModel.from_pretrained(base, adapters[ordered[0]], adapter_name=ordered[0])
    for name in ordered[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    peft.eval()
    pad = base.generation_config.pad_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=None,
                              pad_token_id=pad if pad is not None else 0)
    answers = []
    start = time.perf_counter()
    with torch.no_grad():
        for prompt, name in zip(prompts, names, strict=True):
            peft.set_adapter(name)
            ids = torch.tensor([prompt])
            out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                generation_config=config)
            answers.append([int(t) for t in out[0, len(prompt):]])
    seconds = time.perf_counter() - start
    return {"tokens_per_s": len(prompts) * max_tokens / seconds, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="8 short requests, 1 and 4 adapters")
    parser.add_argument("--model", default="tiny", help="tiny (default) or smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    from pagefleet.worker.model_files import resolve_model_path

    torch.set_num_threads(2)
    model_dir = resolve_model_path(args.model)
    vocab = int(__import__("json").loads((model_dir / "config.json").read_text())["vocab_size"])
    n, prompt_len, max_tokens, counts = args.requests, PROMPT_LEN, MAX_TOKENS, (1, 4, 16)
    if args.smoke:
        n, prompt_len, max_tokens, counts = 8, 16, 4, (1, 4)
    prompts = [common.prompt(prompt_len, seed=i, vocab=vocab) for i in range(n)]
    root = Path(tempfile.mkdtemp(prefix="pagefleet-lora-bench-"))
    adapters = {
        f"a{i:02d}": build_lora_adapter(model_dir, root / f"a{i:02d}", seed=100 + i, std=0.05)
        for i in range(max(counts))
    }
    base = run_engine(args.model, {}, prompts, max_tokens)
    rows: list[tuple[str, dict[str, Any]]] = [("base model alone", base)]
    by_count: dict[int, dict[str, Any]] = {}
    for k in counts:
        subset = {name: adapters[name] for name in sorted(adapters)[:k]}
        by_count[k] = run_engine(args.model, subset, prompts, max_tokens)
        rows.append((f"{k} adapter{'s' if k > 1 else ''}, mixed batch", by_count[k]))
    four = by_count[HF_PEFT_ADAPTERS]
    hf = run_hf_peft(
        model_dir, {n_: adapters[n_] for n_ in sorted(adapters)[:HF_PEFT_ADAPTERS]},
        prompts, four["names"], max_tokens,
    )
    equal = sum(a == b for a, b in zip(four["answers"], hf["answers"], strict=True))
    table = [
        [label, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
         f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}"]
        for label, r in rows
    ]
    table.append([f"HF + PEFT, set_adapter per request ({HF_PEFT_ADAPTERS})",
                  f"{hf['tokens_per_s']:.1f}", f"{hf['tokens_per_s'] / base['tokens_per_s']:.2f}",
                  "1.00"])
    common.print_table(
        f"multi-LoRA on {args.model}: {n} requests x {prompt_len} prompt + {max_tokens} new tokens",
        ["run", "output tok/s", "vs base alone", "vs HF + PEFT"], table,
    )
    print(f"\n{HF_PEFT_ADAPTERS}-adapter outputs equal to HF + PEFT: {equal}/{n}")
    cost = measure_load_cost(args.model, adapters, prompts)
    print(
        f"adapter load into a slot: {cost['load_s'] * 1e3:.2f} ms; prefill of one block: "
        f"{cost['block_s'] * 1e3:.2f} ms; one load = {cost['blocks']:.1f} prefilled blocks "
        f"(router.w_adapter_load)"
    )


if __name__ == "__main__":
    main()
