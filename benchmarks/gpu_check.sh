#!/usr/bin/env bash
# The triton backend on a real GPU, in one go (~5-8 minutes on one H200). Nothing is installed.
#
#   bash benchmarks/gpu_check.sh OUT_DIR        (or OUT=OUT_DIR bash benchmarks/gpu_check.sh)
#
# Writes to OUT_DIR: env.txt, lint.txt (PTX/TTIR lint with the GPU's own Triton), conformance.json /
# conformance.txt (--backend triton --device cuda against the stored goldens), bench.csv / bench.txt
# (lockstep triton vs stock torch, CUDA events, median), log.txt, conformance_seq.* and bench_seq.* (attention /
# GDN kernels, benchmarks/triton_attn_bench.py), attn_train.txt / attn_train.csv (attention forward + the
# deterministic backward kernels vs flash-attn or SDPA, benchmarks/attn_train_bench.py), exact.txt,
# fast_lint.txt / fast.txt / fast.csv / conformance_fast.* (the fast policy, benchmarks/fast_bench.py), rl_parity.txt
# (and jax.txt). Every step is time-boxed; a failing
# step is logged and the next one runs. Other kernel families join through FAMILIES (conformance)
# and benchmarks/triton_bench.py PROVIDERS (benchmark rows).
set -u
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
FAMILIES="${FAMILIES:-matmul rms_norm softmax token_logprobs}"
CONF_ARGS="${CONF_ARGS:-}"          # e.g. --quick
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt"; }
step() {  # step NAME SECONDS OUTFILE CMD...
  local name=$1 secs=$2 file=$3; shift 3
  log "start $name (limit ${secs}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$OUT/$file" 2>&1
  local rc=$?
  log "end $name rc=$rc ($((SECONDS - t0))s)$([ $rc = 124 ] && echo ' TIMED OUT')"
}

{ nvidia-smi || true
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name())"
  "$PY" -m hal.cli info
} > "$OUT/env.txt" 2>&1

step lint 90 lint.txt "$PY" -m hal.kernels.triton.lint
# shellcheck disable=SC2086
step conformance "${CONF_TIMEOUT:-240}" conformance.txt "$PY" -m hal.cli conformance run --backend triton \
  --device cuda --ops $FAMILIES $CONF_ARGS --json "$OUT/conformance.json"
step bench "${BENCH_TIMEOUT:-180}" bench.txt "$PY" -m benchmarks.triton_bench --csv "$OUT/bench.csv"
# Sequence ops (attention, gated delta rule, GDN layer): quick case sets (each crosses every block / split /
# chunk boundary) and their benchmark. SEQ=0 skips them.
if [ "${SEQ:-1}" = 1 ]; then
  step conformance-seq "${SEQ_CONF_TIMEOUT:-200}" conformance_seq.txt "$PY" -m hal.cli conformance run \
    --backend triton --device cuda --ops attention gated_delta_rule gdn_layer --quick --json "$OUT/conformance_seq.json"
  step bench-seq "${SEQ_BENCH_TIMEOUT:-150}" bench_seq.txt "$PY" -m benchmarks.triton_attn_bench --csv "$OUT/bench_seq.csv"
fi
# Attention training step: strict forward + deterministic backward kernels vs flash-attn (else SDPA), T 1k / 4k,
# with an on-GPU determinism (raw bits) and float64-error check of the backward. ATTN_TRAIN=0 skips it.
if [ "${ATTN_TRAIN:-1}" = 1 ]; then
  step attn-train "${ATTN_TRAIN_TIMEOUT:-240}" attn_train.txt "$PY" -m benchmarks.attn_train_bench \
    --csv "$OUT/attn_train.csv"
fi
# The exact (integer) matmul policy: GPU bits vs the CPU reference, then speed vs cuBLAS bf16.
step exact "${EXACT_TIMEOUT:-60}" exact.txt "$PY" -m benchmarks.exact --gpu
# The fast policy (tensor cores, FastMatmulSpec / FastAttentionSpec): matmul batch invariance in raw bits on the
# device, speed vs cuBLAS and flash-attn / SDPA; then the fast conformance families (L0-L3 + A, no L4).
step fast-lint 60 fast_lint.txt "$PY" -m hal.kernels.triton.fast_lint
step fast "${FAST_TIMEOUT:-90}" fast.txt "$PY" -m benchmarks.fast_bench --csv "$OUT/fast.csv"
step conformance-fast "${FAST_CONF_TIMEOUT:-60}" conformance_fast.txt "$PY" -m hal.cli conformance run \
  --backend triton --device cuda --ops matmul_fast attention_fast --quick --json "$OUT/conformance_fast.json"
# End to end: the RL sampler/trainer example on CUDA (lockstep ops are served by the triton backend).
step rl-parity "${RL_TIMEOUT:-90}" rl_parity.txt "$PY" -m examples.rl_parity --device cuda
# JAX (hal.jax) on XLA:GPU, when the jax benchmark module is present.
if [ -f benchmarks/jax_bench.py ]; then
  step jax "${JAX_TIMEOUT:-90}" jax.txt "$PY" -m benchmarks.jax_bench --gpu
fi
log "done"
