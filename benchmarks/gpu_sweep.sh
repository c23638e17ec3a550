#!/usr/bin/env bash
# The alternate perf call, for a lent GPU's time left after gpu_check_8min.sh (run once that one has a complete run
# on record). First the decode-tile fast attention spec (hal.spec.FAST_ATTENTION_DECODE, issue 49: fast work comes
# first) beside the default fast spec's rows of the same shapes: paged decode B8 / B64 and prefill T 2048, each
# decode-tile row checking its raw bits first (decode == its own prefill-sized chunk's last row; prefill's last row ==
# its decode). Then the strict FMA-dot tiles timed under each launch shape (tile, warps, pipeline stages: speed only,
# the bits are the same, and each row checks them against the default's first), against stock in the same run: the
# linear's (benchmarks/gpu_perf.py DOT_TILE_SWEEP, at 2048 and 256 rows, vs cuBLAS), then token_logprobs' logits tile
# (LOGITS_TILE_SWEEP, 256 rows of the 151,936 x 4096 LM head, vs F.linear + log_softmax + gather).
# One call of at most 4 minutes; plan_check adds the stage limits up first. The decode-tile stage (60 s) and the
# plan's reserve displace 50 s of the strict tile sweep (185 s before): its rows past its budget print "not run".
# Nothing installed; no network.
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
plan_check 240 15 "sweep-env:15" "sweep-decode-tile:60" "sweep-ops:135" "sweep-summary:15" || exit 1
step sweep-env "$(limit sweep-env)" sweep_env.txt "${PERF[@]}" --stage env ceilings --budget 8
# the decode-tile rows and the default fast spec's rows they are compared with (not its other paths: /general, ...)
step sweep-decode-tile "$(limit sweep-decode-tile)" sweep_decode_tile.txt "${PERF[@]}" --stage ops --budget 52 \
  --only fast-m16 attention_decode/fast/B attention_prefill/fast/T2048 --skip /general /per_split
step sweep-ops "$(limit sweep-ops)" sweep_ops.txt "${PERF[@]}" --stage ops --budget 122 --only sweep/
step sweep-summary "$(limit sweep-summary)" sweep_summary.txt "${PERF[@]}" --stage summary
log "done"
cat "$OUT/log.txt"
cat "$OUT/summary.txt" 2>/dev/null
