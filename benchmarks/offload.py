"""The KV offload tier against recompute, on multi-turn conversations.

Model: the throughput benchmark's random Llama (8 layers, hidden 512, GQA
8q/2kv, float32; `--smoke`: 2 layers, hidden 64), or `--model` (a local HF
directory, or a name such as `smollm2-135m-instruct`), on `--device` in
`--dtype`. Workload: `conversations` conversations; turn 1 is a
`history`-token prompt, turn 2 is the full history plus turn 1's answer plus
a `question`-token question; each turn generates `output` tokens, greedy.
Every first turn runs, then the second turns arrive one per engine step. The
pool holds only `--pool-share` of the histories' blocks (at least two second
turns' worth), so most first turns are evicted before their second turn; the
tier (`kv_offload_bytes`) is sized to hold them all.

Printed, tier against recompute (tier off, same pool):
- second-turn mean TTFT and second-turn output tokens/s (the whole second
  phase: prefill of what is not cached, copies, decode);
- the second turns' cached tokens against the ideal (every full block of
  each turn-1 history, prompt and answer, comes back);
- the overhead at 0% reuse (goal: under 3%): `--rounds` rounds, each sending
  `--unique` new prompts through the same small pool of one engine with the
  tier and one without (both built once, so from the second round on every
  admission evicts), the two arms interleaved in one process, the first arm
  alternating; the median and range of the per-round ratios of wall and of
  this process's CPU seconds. And the tier's own cost counted directly: its
  host time inside `store` (`offload_store_ns`: bookkeeping and copies) per
  spilled block, the bytes copied, and that time as a share of the arm's wall
  time. On CUDA the copies are asynchronous, so that share is the time to
  issue them.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import _engine_bench as common
import torch
from throughput import FULL_MODEL, SMOKE_MODEL

BLOCK_SIZE = 16


def conversation_prompts(n: int, history: int, seed: int) -> list[list[int]]:
    return [common.prompt(history, seed=seed + i) for i in range(n)]


def make_llm(args: argparse.Namespace, model: Any, num_blocks: int, offload_bytes: int) -> Any:
    from pagefleet import LLM

    return LLM(model=model, block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
               kv_offload_bytes=offload_bytes, max_num_batched_tokens=2048,
               device=args.device, dtype=args.dtype)  # fmt: skip


def multi_turn(llm: Any, firsts: list[list[int]], question: int, output: int) -> dict[str, Any]:
    turn1 = common.timed_requests(llm.engine, firsts, output)
    seconds = [
        p + a + common.prompt(question + 1, seed=50_000 + i)[1:]
        for i, (p, a) in enumerate(zip(firsts, turn1["answers"], strict=True))
    ]
    turn2 = common.timed_requests(llm.engine, seconds, output)
    llm.check_integrity()
    turn2["stats"] = llm.stats()
    return turn2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="4 short conversations, 2 rounds (and a tiny model unless --model)")
    parser.add_argument("--model", help="a local HF directory or a model name instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--history", type=int, default=320)
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--output", type=int, default=8)
    parser.add_argument("--pool-share", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=8, help="0%% reuse: rounds of both arms")
    parser.add_argument("--unique", type=int, help="0%% reuse: prompts per arm and round "
                        "(default: twice the conversations)")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--part", choices=("all", "multi-turn", "no-reuse"), default="all",
                        help="run only one of the two workloads")
    args = parser.parse_args()
    if args.smoke:
        args.conversations, args.history, args.question, args.output = 4, 64, 8, 4
        args.rounds = 2
    model_kwargs = None if args.model else SMOKE_MODEL if args.smoke else FULL_MODEL
    if args.threads:
        torch.set_num_threads(args.threads)
    model: Any = args.model or common.build_model(model_kwargs or {})

    per_turn2 = -(-(args.history + 2 * args.output + args.question) // BLOCK_SIZE)
    history_blocks = args.conversations * -(-(args.history + args.output) // BLOCK_SIZE)
    num_blocks = max(int(history_blocks * args.pool_share), 2 * per_turn2)
    # The recompute engine comes first: it also tells the size of a block.
    recompute = make_llm(args, model, num_blocks, 0)
    bytes_per_block = recompute.engine.kv.bytes_per_block
    desc = (f"model: Llama {model_kwargs['num_hidden_layers']} layers, hidden "
            f"{model_kwargs['hidden_size']}" if model_kwargs else f"model: {model}")
    # The tier holds every block both turns ever compute, with room to spare.
    offload_bytes = 2 * args.conversations * per_turn2 * bytes_per_block
    print(f"{desc}, {args.dtype}, {args.device}, {torch.get_num_threads()} threads; {args.conversations} conversations, history "
          f"{args.history} tokens, question {args.question}, output {args.output}; pool "
          f"{num_blocks} blocks of {BLOCK_SIZE} ({num_blocks / history_blocks:.0%} of the "
          f"histories), tier {offload_bytes / 2**20:.1f} MiB ({bytes_per_block} bytes per block)")

    if args.part != "no-reuse":
        report_multi_turn(args, recompute, make_llm(args, model, num_blocks, offload_bytes))
    del recompute
    if args.part != "multi-turn":
        arms = {"tier off": make_llm(args, model, num_blocks, 0),
                "tier on": make_llm(args, model, num_blocks, offload_bytes)}  # fmt: skip
        report_no_reuse(args, arms, bytes_per_block)


def report_multi_turn(args: argparse.Namespace, recompute: Any, tier: Any) -> None:
    firsts = conversation_prompts(args.conversations, args.history, seed=1000)
    off = multi_turn(recompute, firsts, args.question, args.output)
    on = multi_turn(tier, firsts, args.question, args.output)
    same = off["answers"] == on["answers"]
    ideal = args.conversations * ((args.history + args.output - 1) // BLOCK_SIZE) * BLOCK_SIZE
    rows = []
    for name, r in (("recompute (tier off)", off), ("offload tier", on)):
        st = r["stats"]
        rows.append([
            name, f"{r['cached'] / ideal:.1%}", f"{st.offload_hit_tokens}",
            f"{st.offload_bytes_out / 2**20:.1f}", f"{st.offload_bytes_in / 2**20:.1f}",
            f"{(st.offload_store_ns + st.offload_load_ns) / 1e6:.1f}",
            f"{r['ttft'] * 1000:.0f}", f"{r['tokens_per_s']:.1f}",
        ])
    common.print_table(
        "second turns",
        ["mode", "cached vs ideal", "tier hit tokens", "MiB out", "MiB in", "tier ms",
         "mean TTFT ms", "tokens/s"],
        rows,
    )
    print(f"\nsecond-turn TTFT recompute/tier: {off['ttft'] / on['ttft']:.2f}x; "
          f"throughput tier/recompute: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x; "
          f"tier hit rate vs ideal: {on['cached'] / ideal:.1%}; "
          f"outputs equal with and without the tier: {same}")


def report_no_reuse(args: argparse.Namespace, arms: dict[str, Any], bytes_per_block: int) -> None:
    # 0% reuse: every prompt is new, so the tier only ever costs copies out.
    unique = args.unique or 2 * args.conversations
    for i, llm in enumerate(arms.values()):  # first calls pay one-time costs: not timed
        common.timed_requests(llm.engine, [common.prompt(24, seed=80_000 + i)], 2)
    rows, wall, cpu, share, same = [], [], [], [], True
    spilled = store_ns = copied = 0
    for r in range(args.rounds):
        prompts = conversation_prompts(unique, args.history, seed=90_000 + r * unique)
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        res: dict[str, dict[str, Any]] = {}
        for name in order:
            before = arms[name].stats()
            res[name] = common.timed_requests(arms[name].engine, prompts, args.output)
            after = arms[name].stats()
            counters, start = after.as_dict(), before.as_dict()
            res[name]["delta"] = {k: counters[k] - start[k] for k in counters}
        off, on = res["tier off"], res["tier on"]
        same = same and (off["answers"], off["steps"]) == (on["answers"], on["steps"])
        d = on["delta"]
        blocks = d["offload_bytes_out"] // bytes_per_block
        spilled, store_ns, copied = (spilled + blocks, store_ns + d["offload_store_ns"],
                                     copied + d["offload_bytes_out"])  # fmt: skip
        wall.append(on["seconds"] / off["seconds"] - 1)
        cpu.append(on["cpu_seconds"] / off["cpu_seconds"] - 1)
        share.append(d["offload_store_ns"] / 1e9 / on["seconds"])
        rows.append([
            f"{r + 1}", " then ".join(n.split()[1] for n in order), f"{off['seconds']:.2f}",
            f"{on['seconds']:.2f}", f"{wall[-1]:+.1%}", f"{cpu[-1]:+.1%}", f"{blocks}",
            f"{d['offload_store_ns'] / 1e6:.1f}", f"{share[-1]:.2%}",
        ])
    common.print_table(
        f"0% reuse: {args.rounds} rounds of {unique} unique prompts per arm",
        ["round", "order", "off s", "on s", "wall on/off", "CPU on/off", "blocks spilled",
         "store ms", "store / wall"],
        rows,
    )
    assert arms["tier on"].stats().offload_hit_tokens == 0, "a 0% reuse run hit the tier"
    for llm in arms.values():
        llm.check_integrity()
    per_block_us = store_ns / 1e3 / spilled if spilled else 0.0
    print(f"\ntier's own cost: {spilled} blocks spilled, {copied / 2**20:.1f} MiB copied, "
          f"{per_block_us:.1f} us per block in store ({copied / max(store_ns, 1):.2f} GB/s); "
          f"median {statistics.median(share):.2%} of the tier arm's wall time")
    print(f"outputs and engine steps equal with and without the tier at 0% reuse: {same}")
    print(f"overhead of the tier at 0% reuse: median {statistics.median(wall):+.1%} wall "
          f"(range {min(wall):+.1%} to {max(wall):+.1%}), median {statistics.median(cpu):+.1%} "
          f"CPU time (range {min(cpu):+.1%} to {max(cpu):+.1%}) (goal under 3%)")


if __name__ == "__main__":
    main()
