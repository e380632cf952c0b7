"""Prefix caching on versus off, on groups of requests that share a long system prompt.

Model: the throughput benchmark's random Llama (8 layers, hidden 512, GQA
8q/2kv, float32, CPU; `--smoke`: 2 layers, hidden 64). Workload: 4 groups
x 6 requests (`--smoke`: 2 x 3); each group shares a 512-token system
prompt (`--smoke`: 64), each request adds its own 32-token question
(`--smoke`: 8) and generates 16 tokens (`--smoke`: 4), greedy. Requests
arrive one per engine step, round robin over the groups, so each group's
first request is computed before the group's next one arrives;
`--together` submits them all before the first step instead (one
`generate` call): the engine itself must then hold a group's followers back
a step so that they hit the first one's blocks.

Ideal hit tokens: every request after the first of its group reuses the
system prompt's full blocks. Printed: hit rate against that ideal, mean time
to first token, output tokens/s, and the ratios on/off.
"""

from __future__ import annotations

import argparse
from typing import Any

import _engine_bench as common
from throughput import FULL_MODEL, SMOKE_MODEL

BLOCK_SIZE = 16


def workload(groups: int, per_group: int, system_len: int, question_len: int) -> list[list[int]]:
    systems = [common.prompt(system_len, seed=1000 + g) for g in range(groups)]
    out = []
    for i in range(per_group):
        for g in range(groups):
            question = common.prompt(question_len + 1, seed=10_000 + 100 * g + i)[1:]
            out.append(systems[g] + question)
    return out


def run(model_dir: object, prompts: list[list[int]], max_tokens: int, caching: bool,
        together: bool = False) -> dict[str, Any]:
    from pagefleet import LLM

    llm = LLM(model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=1024,
              enable_prefix_caching=caching, max_num_batched_tokens=2048)
    result = common.timed_requests(llm.engine, prompts, max_tokens, together=together)
    stats = llm.stats()
    llm.check_integrity()
    return {**result, "hit_tokens": stats.prefix_hit_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and 6 short requests")
    parser.add_argument("--together", action="store_true",
                        help="submit every request before the first step")
    args = parser.parse_args()
    if args.smoke:
        model_kwargs, groups, per_group, system_len, question_len, max_tokens = SMOKE_MODEL, 2, 3, 64, 8, 4
    else:
        model_kwargs, groups, per_group, system_len, question_len, max_tokens = FULL_MODEL, 4, 6, 512, 32, 16
    model_dir = common.build_model(model_kwargs)
    prompts = workload(groups, per_group, system_len, question_len)
    prompt_tokens = sum(len(p) for p in prompts)
    ideal_hits = groups * (per_group - 1) * (system_len // BLOCK_SIZE) * BLOCK_SIZE
    print(f"model: Llama {model_kwargs['num_hidden_layers']} layers, hidden "
          f"{model_kwargs['hidden_size']}, float32, CPU; {groups} groups x {per_group} requests, "
          f"system prompt {system_len} tokens, question {question_len}, output {max_tokens}")
    off = run(model_dir, prompts, max_tokens, caching=False, together=args.together)
    on = run(model_dir, prompts, max_tokens, caching=True, together=args.together)
    rows = []
    for name, r in (("caching off", off), ("caching on", on)):
        rows.append([
            name, f"{r['hit_tokens'] / prompt_tokens:.1%}", f"{ideal_hits / prompt_tokens:.1%}",
            f"{r['ttft'] * 1000:.0f}", f"{r['tokens_per_s']:.1f}", f"{r['seconds']:.2f}",
        ])
    common.print_table("prefix cache", ["mode", "hit rate", "ideal", "mean TTFT ms", "tokens/s", "seconds"], rows)
    print(f"\nhit tokens vs ideal: {on['hit_tokens'] / ideal_hits:.1%}; "
          f"throughput on/off: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x; "
          f"TTFT off/on: {off['ttft'] / on['ttft']:.2f}x")


if __name__ == "__main__":
    main()
