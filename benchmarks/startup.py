"""Start-up: from launching `pagefleet serve` to its first answered chat request.

Targets (issue 18): warm (the GGUF already converted, the C decode kernel
already built) <= 15 s, cold (an empty `PAGEFLEET_CACHE_DIR`: the GGUF
dequantized into safetensors and the kernel compiled first) <= 40 s.

Each round launches `python -m pagefleet serve --model MODEL` (a local Ray, two
CPU workers, its defaults) in a session of its own, polls its OpenAI port until
one chat completion (8 tokens, greedy) answers, records the seconds from
launch to the banner ("Ctrl-C to stop.") and to that answer, and stops the
server with SIGINT (waiting for it to exit before the next round). Cold rounds
run first, each with a fresh cache directory; warm rounds share one cache
directory a cold round filled.

Peer (optional, `--vllm-python`, default /opt/vllm-venv/bin/python): `vllm serve`
on the same converted checkpoint, float32, its default CPU compilation, every
core, polled the same way; its first answer's time is the ratio's denominator.
Without vLLM the rows print against the targets alone, with a note.
The figures are wall clock: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_cpu import DEFAULT_VLLM_PYTHON, vllm_env, vllm_version

DEFAULT_MODEL = "smollm2-135m-instruct"
TARGETS_S = {"cold": 40.0, "warm": 15.0}
BANNER = "Ctrl-C to stop."
START_TIMEOUT_S = 600.0
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0}  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def first_answer(
    port: int, proc: subprocess.Popen[bytes], started: float, log: Path | None = None
) -> tuple[float | None, float]:
    """(seconds from `started` until `log` shows the banner, None without a log; seconds
    until a chat completion on `port` answers 200)."""
    body = json.dumps({**CHAT, "model": "default"}).encode()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    ready: float | None = None
    while time.monotonic() - started < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        if log is not None and ready is None and BANNER in log.read_text():
            ready = time.monotonic() - started
        request = urllib.request.Request(url, body, {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                if reply.status == 200:
                    json.load(reply)
                    return ready, time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"no answer within {START_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT the server's session and wait for it; SIGKILL what is left after 120 s."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def pagefleet_round(model: str, cache_dir: Path, log: Path) -> tuple[float, float]:
    """(seconds to the banner, seconds to the first answer) of one `pagefleet serve`."""
    port = free_port()
    env = {**os.environ, "PAGEFLEET_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, "-m", "pagefleet", "serve", "--model", model, "--grpc-port", "0",
           "--http-port", str(port), "--metrics-port", "-1"]  # fmt: skip
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        ready, answered = first_answer(port, proc, started, log)
        return (ready if ready is not None else answered), answered
    finally:
        stop(proc)


def vllm_round(python: Path, model_dir: Path, log: Path) -> float:
    """Seconds from launching `vllm serve` to its first answer."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "default", "--dtype", "float32", "--port", str(port),
           "--host", "127.0.0.1"]  # fmt: skip
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=vllm_env(),
                                start_new_session=True)  # fmt: skip
    try:
        return first_answer(port, proc, started)[1]
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3, help="warm rounds (and vLLM rounds)")
    parser.add_argument("--cold-rounds", type=int, default=1)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.1f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="pagefleet-startup-"))
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    warm_cache = work / "cache-warm"
    for i in range(args.cold_rounds):
        cache = warm_cache if i == 0 else work / f"cache-cold-{i}"
        rows["cold"].append(pagefleet_round(args.model, cache, work / f"cold-{i}.log"))
        print(f"cold round {i + 1}: ready {rows['cold'][-1][0]:.1f} s, "
              f"first answer {rows['cold'][-1][1]:.1f} s", flush=True)  # fmt: skip
    if args.cold_rounds == 0:
        pagefleet_round(args.model, warm_cache, work / "fill.log")  # fills the warm cache
    for i in range(args.rounds):
        rows["warm"].append(pagefleet_round(args.model, warm_cache, work / f"warm-{i}.log"))
        print(f"warm round {i + 1}: ready {rows['warm'][-1][0]:.1f} s, "
              f"first answer {rows['warm'][-1][1]:.1f} s", flush=True)  # fmt: skip
    version, note = vllm_version(args.vllm_python)
    vllm_times: list[float] = []
    if version is not None:
        env = {**os.environ, "PAGEFLEET_CACHE_DIR": str(warm_cache)}
        model_dir = subprocess.run(
            [sys.executable, "-c", "import sys; from pagefleet.worker.model_files import "
             "resolve_model_path; print(resolve_model_path(sys.argv[1]))", args.model],
            capture_output=True, text=True, check=True, env=env,
        ).stdout.strip()  # fmt: skip
        for i in range(args.rounds):
            vllm_times.append(vllm_round(args.vllm_python, Path(model_dir), work / f"vllm-{i}.log"))
            print(f"vLLM round {i + 1}: first answer {vllm_times[-1]:.1f} s", flush=True)
    print(note)
    peer = statistics.median(vllm_times) if vllm_times else None
    print(f"\nstart-up of `pagefleet serve --model {args.model}` to its first answer "
          f"(median of rounds; logs in {work})")  # fmt: skip
    print(f"{'start':<6} {'rounds':>6} {'ready s':>8} {'answer s':>9} {'target s':>9} "
          f"{'x target':>9} {'x vLLM':>7}")  # fmt: skip
    for kind, runs in rows.items():
        if not runs:
            continue
        ready = statistics.median(r for r, _ in runs)
        answer = statistics.median(a for _, a in runs)
        versus = f"{answer / peer:.2f}" if peer else "-"
        print(f"{kind:<6} {len(runs):>6} {ready:>8.1f} {answer:>9.1f} {TARGETS_S[kind]:>9.0f} "
              f"{answer / TARGETS_S[kind]:>9.2f} {versus:>7}")  # fmt: skip
    if peer is not None:
        print(f"{'vLLM':<6} {len(vllm_times):>6} {'-':>8} {peer:>9.1f} {'-':>9} {'-':>9} "
              f"{1.0:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
