#!/usr/bin/env bash
# The strict FMA-dot tiles timed under each launch shape (tile, warps, pipeline stages: speed only, the bits are the
# same, and each row checks them against the default's first), against stock in the same run: the linear's
# (benchmarks/gpu_perf.py DOT_TILE_SWEEP, at 2048 and 256 rows, vs cuBLAS), then token_logprobs' logits tile
# (LOGITS_TILE_SWEEP, 256 rows of the 151,936 x 4096 LM head, vs F.linear + log_softmax + gather).
# For a lent GPU's time left after gpu_check_8min.sh: one call of at most 4 minutes. Nothing installed; no network.
#
#   bash benchmarks/gpu_sweep.sh OUT_DIR          (the device call's timeout_s = 240)
#   bash benchmarks/gpu_sweep.sh --dry-run OUT    (CPU: the same stages in the Triton interpreter at tiny shapes)
#
# Then keep the fastest: kernels/triton/matmul.py's _DOT_TILE, _DOT_WARPS, _DOT_STAGES and token_logprobs.py's
# _DOT_TILE, _DOT_WARPS, _DOT_STAGES. summary.txt: every row's ratio and share of the fp32 ceiling.
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh
perf_setup "$0" gpu-sweep-out "$@"
step sweep-env 25 sweep_env.txt "${PERF[@]}" --stage env ceilings --budget 10
step sweep-ops 185 sweep_ops.txt "${PERF[@]}" --stage ops --budget 170 --only sweep/
step sweep-summary 15 sweep_summary.txt "${PERF[@]}" --stage summary
log "done"
cat "$OUT/log.txt"
cat "$OUT/summary.txt" 2>/dev/null
