#!/usr/bin/env bash
# The exact policy's fast path on the device (issue 53 item 2): the int8 accumulation probe (kernels/exact/probe.py:
# the row fails unless every Triton int8 path, the fused kernel included, and torch._int_mm accumulate exactly here),
# then hal.linear under ExactMatmulSpec(slices = 3 and 4) on the triton backend at 1 / 8 / 64 / 2048 / 8192 rows x
# K = N = 4096 (bf16, weight prepared once), by CUDA-graph replay against cuBLAS bf16, each row's first input set
# checked against the reference's raw bits first (kernels/reference/exact_matmul on the CPU, four rows of it); the
# default fused kernel (exact/s*/M*, reading the weight's int8 planes), the fused kernel slicing the bf16 weight in
# registers at the decode rows 1 / 8 / 64 (exact/s*/M*/weight-source: its bytes against the planes', which decides
# the decode default) and the two-kernel path at 1 / 64 / 2048 / 8192 (exact/s*/M*/two-kernel) in the same run, in
# that order (rows past the stage budget are logged as not run).
# An alternate perf script (benchmarks/gpu_check_8min.sh's plan): run once the fast policy's and the RL step's
# device calls are on record, in a lent GPU's time left after them: one call of at most 4 minutes. Nothing
# installed; no network.
#
#   bash benchmarks/gpu_exact.sh OUT_DIR          (the device call's timeout_s = 240)
#   bash benchmarks/gpu_exact.sh --dry-run OUT    (CPU: the same stages in the Triton interpreter at tiny shapes)
#
# summary.txt: every row's ratio to cuBLAS bf16 (issue 53's targets: prefill s = 3 >= 0.11x, s = 4 >= 0.06x;
# decode 1-64 rows >= 0.35x) and the replay-vs-eager bits.
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh
perf_setup "$0" gpu-exact-out "$@"
plan_check 240 15 "exact-env:25" "exact-ops:185" "exact-summary:15" || exit 1
step exact-env "$(limit exact-env)" exact_env.txt "${PERF[@]}" --stage env ceilings --budget 10
step exact-ops "$(limit exact-ops)" exact_ops.txt "${PERF[@]}" --stage ops --budget 170 --only exact_probe exact/s
step exact-summary "$(limit exact-summary)" exact_summary.txt "${PERF[@]}" --stage summary
log "done"
cat "$OUT/log.txt"
cat "$OUT/summary.txt" 2>/dev/null
