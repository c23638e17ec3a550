#!/usr/bin/env bash
# Superseded by benchmarks/gpu_check_8min.sh (issue 40: every op's ratio to stock, profiles, a symptom summary).
# One prepared device call of at most 6 minutes (a lent H200: 15 device-minutes per task, start-up included).
#
#   bash benchmarks/gpu_check_6min.sh OUT_DIR          (run with the call's timeout_s = 360)
#   bash benchmarks/gpu_check_6min.sh --dry-run OUT    (CPU: bash syntax, then each python stage's CPU dry run)
#
# Most informative first, each stage time-boxed on its own (a slow stage cannot eat the next): 320 s of limits,
# at most 350 s with each stage's 10 s kill grace, plus a few seconds of env.txt:
#   graph        120 s       graph.txt/.csv: decode GEMV, rms_norm, token_logprobs, paged decode attention at the
#                            target shapes: launch path captured under set_sync_debug_mode("error"), replayed,
#                            eager bits == replay bits, per-call eager / launch-path / replay microseconds
#                            (the kernels' first compiles count in the same stage)
#   conformance  110 s       conformance.txt/.json: foundation families (matmul rms_norm softmax token_logprobs),
#                            quick case sets on CUDA: every level the triton backend claims (L1 batch
#                            invariance ... A), L4 against the CPU goldens
#   fast         90 s        fast.txt (its csv is not kept: 8 files at most): fast matmul / attention speed vs
#                            cuBLAS and flash-attn / SDPA
# Files: env.txt log.txt graph.txt graph.csv conformance.txt conformance.json fast.txt (7 of the 8 allowed).
# torch 2.11 APIs only (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.set_sync_debug_mode, CUDA events);
# no HF path, so no transformers wheel is carried. Nothing is installed.
set -u
cd "$(dirname "$0")/.."
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh

if [ -n "$DRY" ]; then  # CPU: the same python entry points, interpreter-sized, no GPU needed
  bash -n "$0" && log "bash -n ok"
  export TRITON_INTERPRET=1
  step graph 300 graph.txt "$PY" -m benchmarks.triton_host_overhead --graph --dry-run --device cpu \
    --csv "$OUT/graph.csv"
  step graph-cpu 30 graph_cpu.txt "$PY" -m benchmarks.triton_host_overhead --graph --device cpu
  step parse 60 parse.txt "$PY" -c "import benchmarks.fast_bench, hal.cli; print('imports ok')"
  log "dry run done"
  exit 0
fi
unset TRITON_INTERPRET

{ nvidia-smi || true
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1

step graph "${GRAPH_TIMEOUT:-120}" graph.txt "$PY" -m benchmarks.triton_host_overhead --graph --device cuda \
  --csv "$OUT/graph.csv"
step conformance "${CONF_TIMEOUT:-110}" conformance.txt "$PY" -m hal.cli conformance run --backend triton \
  --device cuda --ops matmul rms_norm softmax token_logprobs --quick --json "$OUT/conformance.json"
step fast "${FAST_TIMEOUT:-90}" fast.txt "$PY" -m benchmarks.fast_bench --csv /tmp/fast.csv --repeats 10 \
  --max-seconds 1.0
log "done"
