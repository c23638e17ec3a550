#!/usr/bin/env bash
# The triton backend (and hal.jax) on a real GPU, in one go. Nothing is installed.
#
#   bash benchmarks/gpu_check.sh OUT_DIR        (or OUT=OUT_DIR bash benchmarks/gpu_check.sh)
#   STEPS="lint conformance-seq attn-train" bash benchmarks/gpu_check.sh OUT_DIR   (only these steps)
#
# Every step is time-boxed (its *_TIMEOUT variable); a failing step is logged and the next one runs. All steps
# together need more than one 8-minute device call: on a 15-minute lease run benchmarks/gpu_check_8min.sh (one
# prepared call, the current GPU check: docs/triton.md "GPU check"); here, split them over calls with STEPS. Steps and what they write to OUT_DIR (plus env.txt and log.txt):
#   lint              lint.txt: PTX/TTIR lint of the strict kernels with the GPU's own Triton
#   conformance       conformance.txt/.json: the foundation suites (SUITES; CONF_ARGS=--quick) vs the goldens
#   bench             bench.txt/.csv: strict triton vs stock torch, CUDA events, median
#   host              host.csv/host.txt: per-call host time vs CUDA-event time vs CUDA graph (small shapes)
#   conformance-seq   conformance_seq.*: attention, gated_delta_rule, gdn_layer quick sets
#   bench-seq         bench_seq.*: attention / GDN kernels vs stock (benchmarks/triton_attn_bench.py)
#   attn-train        attn_train.*: attention forward + deterministic backward kernels vs flash-attn / SDPA
#   gdn-train         gdn_train.txt: GDN forward + chunked backward (Triton scan, and torch scan) vs transformers'
#                     torch path, T 512 / 4096
#   exact             exact.txt: the exact (int8) policy, GPU bits vs the CPU reference, speed vs cuBLAS bf16
#   fast-lint, fast, conformance-fast   the fast policy: lint, speed vs cuBLAS / flash-attn, L0-L3 + A
#   rl-parity         rl_parity.txt: examples.rl_parity on CUDA
#   jax               jax.txt: hal.jax on XLA:GPU (bits vs XLA:CPU, speed)
# Other conformance suites join through SUITES (FAMILIES, its older name, is still read), other kernels
# through benchmarks/triton_bench.py PROVIDERS.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
SUITES="${SUITES:-${FAMILIES:-matmul rms_norm softmax token_logprobs}}"
CONF_ARGS="${CONF_ARGS:-}"          # e.g. --quick
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh

{ nvidia-smi || true
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name())"
  "$PY" -m hal.cli info
} > "$OUT/env.txt" 2>&1

step lint 90 lint.txt "$PY" -m hal.kernels.checks.lint
# shellcheck disable=SC2086
step conformance "${CONF_TIMEOUT:-240}" conformance.txt "$PY" -m hal.cli conformance run --backend triton \
  --device cuda --ops $SUITES $CONF_ARGS --json "$OUT/conformance.json"
step bench "${BENCH_TIMEOUT:-180}" bench.txt "$PY" -m benchmarks.triton_bench --csv "$OUT/bench.csv"
step host "${HOST_TIMEOUT:-90}" host.txt "$PY" -m benchmarks.triton_host_overhead --device cuda --csv "$OUT/host.csv"
# Sequence ops (attention, gated delta rule, GDN layer): quick case sets (each crosses every block / split /
# chunk boundary) and their benchmark.
step conformance-seq "${SEQ_CONF_TIMEOUT:-200}" conformance_seq.txt "$PY" -m hal.cli conformance run \
  --backend triton --device cuda --ops attention gated_delta_rule gdn_layer --quick --json "$OUT/conformance_seq.json"
step bench-seq "${SEQ_BENCH_TIMEOUT:-150}" bench_seq.txt "$PY" -m benchmarks.triton_attn_bench --csv "$OUT/bench_seq.csv"
# Attention training step: strict forward + deterministic backward kernels vs flash-attn (else SDPA), T 1k / 4k,
# with an on-GPU determinism (raw bits) and float64-error check of the backward.
step attn-train "${ATTN_TRAIN_TIMEOUT:-240}" attn_train.txt "$PY" -m benchmarks.attn_train_bench \
  --csv "$OUT/attn_train.csv"
# Gated delta rule training step: strict forward + the chunked (WY/UT) backward, its chunk-state scan in Triton
# (and a torch-scan row), vs transformers' torch path.
step gdn-train "${GDN_TRAIN_TIMEOUT:-180}" gdn_train.txt "$PY" -m benchmarks.gdn_backward --device cuda \
  --T 512 4096 --repeats 3 --no-recurrent
# The exact (integer) matmul policy: GPU bits vs the CPU reference, then speed vs cuBLAS bf16.
step exact "${EXACT_TIMEOUT:-60}" exact.txt "$PY" -m benchmarks.exact --gpu
# The fast policy (tensor cores, FastMatmulSpec / FastAttentionSpec / FastGatedDeltaRuleSpec): matmul batch
# invariance in raw bits on the device, speed vs cuBLAS and flash-attn / SDPA; then the fast conformance families
# (L0-L3 + A, no L4).
step fast-lint 60 fast_lint.txt "$PY" -m hal.kernels.checks.fast_lint
step fast "${FAST_TIMEOUT:-90}" fast.txt "$PY" -m benchmarks.fast_bench --csv "$OUT/fast.csv"
# (gated_delta_rule_fast: the fast GDN kernel's compile and its quick case's ~40 calls, hence 60 -> 120 s)
step conformance-fast "${FAST_CONF_TIMEOUT:-120}" conformance_fast.txt "$PY" -m hal.cli conformance run \
  --backend triton --device cuda --ops matmul_fast attention_fast gated_delta_rule_fast --quick \
  --json "$OUT/conformance_fast.json"
# End to end: the RL sampler/trainer example on CUDA (lockstep ops are served by the triton backend).
step rl-parity "${RL_TIMEOUT:-90}" rl_parity.txt "$PY" -m examples.rl_parity --device cuda
# JAX (hal.jax) on XLA:GPU.
step jax "${JAX_TIMEOUT:-90}" jax.txt "$PY" -m benchmarks.jax_bench --gpu
log "done"
