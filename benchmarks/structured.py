"""Structured output's cost: a mixed batch (half the rows under a JSON schema) against the
same batch unconstrained, in output tokens/s, and the grammar's own time per constrained token.

Model: `--model` (default smollm2-135m-instruct; `--smoke`: tiny), float32,
CPU, `--threads` torch threads. Workload: `--requests` chat prompts (default
8), `--max-tokens` greedy tokens each (default 64), all submitted in one
`LLM.generate` call. Rows: every request unconstrained (EOS ignored), half
of them under the schema (the others as before), all under it. The schema
(an object holding an array of 40 strings of 4-12 characters) cannot be
complete within the budget, so every constrained row runs to `max_tokens`
like the unconstrained ones: each row generates the same number of tokens.
The grammar is compiled by a warm-up request first (its compile time is
printed apart). Each row runs `--rounds` times, interleaved, and keeps its
best time (the machine is shared). The grammar's time is the time spent in
`mask_logits` (filling and applying the bitmasks) and in the matchers'
`accept`, counted around those calls during the timed runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import _engine_bench as common
import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "minLength": 4, "maxLength": 12},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["notes"],
}
TOPICS = ("Paris", "the sea", "a forest", "Rome", "winter", "a library", "trains", "bread")


class GrammarClock:
    """Seconds spent in the engine's grammar calls (mask_logits, TokenMatcher.accept)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.accepted = 0

    def wrap(self, fn: Callable[..., Any], count: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.accepted += int(count)

        return timed


def install(clock: GrammarClock) -> None:
    import pagefleet.worker.engine as engine_module
    from pagefleet.worker.grammar import TokenMatcher

    engine_module.mask_logits = clock.wrap(engine_module.mask_logits)  # type: ignore[assignment]
    TokenMatcher.accept = clock.wrap(TokenMatcher.accept, count=True)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, 4 requests, 8 tokens, 1 round")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.requests, args.max_tokens, args.rounds = "tiny", 4, 8, 1
    torch.set_num_threads(args.threads)

    from pagefleet import LLM, SamplingParams
    from pagefleet.worker.chat import chat_prompt
    from pagefleet.worker.structured_output import StructuredOutput

    llm = LLM(args.model, dtype="float32", max_num_seqs=max(args.requests, 1))
    prompts = [
        chat_prompt([{"role": "user", "content": f"Write notes about {TOPICS[i % len(TOPICS)]}."}],
                    llm.tokenizer)
        for i in range(args.requests)
    ]  # fmt: skip
    spec = StructuredOutput(json_schema=SCHEMA)
    free = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, structured=spec)
    half = args.requests // 2
    rows: dict[str, list[SamplingParams]] = {
        "unconstrained": [free] * args.requests,
        f"mixed: {half} of {args.requests} under the schema": [constrained] * half
        + [free] * (args.requests - half),
        "all under the schema": [constrained] * args.requests,
    }

    start = time.perf_counter()
    llm.engine.grammars.compile(spec)
    compile_s = time.perf_counter() - start
    llm.generate(prompts[:2], [free, constrained])  # warm-up (the matcher's first masks too)

    clock = GrammarClock()
    install(clock)
    best: dict[str, float] = {}
    grammar_s: dict[str, float] = {}
    accepted: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, params in rows.items():
            clock.seconds, clock.accepted = 0.0, 0
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
            count = sum(len(o.token_ids) for o in outs)
            if name not in best or seconds < best[name]:
                best[name], grammar_s[name], accepted[name] = seconds, clock.seconds, clock.accepted
                tokens[name] = count
            cut = [o.finish_reason for o, p in zip(outs, params, strict=True) if p.structured]
            assert all(r == "length" for r in cut), f"a constrained row ended early: {cut}"

    base = tokens["unconstrained"] / best["unconstrained"]
    table = []
    for name in rows:
        rate = tokens[name] / best[name]
        per_token = 1e3 * grammar_s[name] / accepted[name] if accepted[name] else 0.0
        table.append([
            name, str(tokens[name]), f"{best[name]:.2f}", f"{rate:.1f}", f"{rate / base:.3f}",
            f"{per_token:.3f}" if accepted[name] else "-",
            f"{100 * grammar_s[name] / best[name]:.1f}%",
        ])  # fmt: skip
    common.print_table(
        f"{args.model}, {args.requests} requests x {args.max_tokens} tokens, "
        f"{args.threads} threads, best of {args.rounds}",
        ["batch", "tokens", "s", "tok/s", "vs unconstrained", "grammar ms/constrained token",
         "grammar share of wall"],
        table,
    )  # fmt: skip
    print(f"\nschema compiled once in {1e3 * compile_s:.1f} ms")
    mixed = next(name for name in rows if name.startswith("mixed"))
    print(f"mixed batch tokens/s vs unconstrained: {tokens[mixed] / best[mixed] / base:.3f}")


if __name__ == "__main__":
    main()
