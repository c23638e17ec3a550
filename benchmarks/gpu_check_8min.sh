#!/usr/bin/env bash
# The current GPU check (issue 40): one prepared device call of at most 8 minutes that measures and diagnoses
# every op, then runs the GPU conformance quick sets. gpu_check.sh keeps the
# longer steps for a longer lease. Nothing is installed; no network.
#
#   bash benchmarks/gpu_check_8min.sh OUT_DIR          (the device call's timeout_s = 480)
#   bash benchmarks/gpu_check_8min.sh --dry-run OUT    (CPU: bash -n, then the same stages on CPU stand-ins)
#
# Stages (each its own process and limit, so a stage that runs out keeps its rows and the next one runs;
# every python stage also stops itself at its --budget, a few seconds earlier). Limits add up to 460 s, plus
# env.txt, inside the 480 s call:
#   perf-env      25 s   env.json, ceilings.jsonl: versions; copy bandwidth, bf16 / fp32 (TF32 off) matmul
#   perf-ops-a    60 s   ops.jsonl, ops.csv, kernels.jsonl: rms_norm, softmax family, token_logprobs vs stock,
#                        CUDA-graph replay over rotated input sets
#   perf-ops-b    75 s   the same files: linear, decode rows 1-256 and prefill 2k / 8k, strict / fast / exact;
#                        silu_mul, apply_rotary
#   perf-ops-c    80 s   the same files: paged decode / prefill attention (strict, fast), GDN decode / chunked
#   perf-profile  30 s   profile.jsonl, profile.txt: torch.profiler of the 4 worst rows
#   perf-ncu      40 s   ncu.jsonl, ncu_0.csv: Nsight Compute on the 3 worst kernels (absent / failing: logged)
#   perf-summary  15 s   summary.jsonl, summary.txt: every row, then the symptoms of each slow row
#   conformance-seq 135 s conformance_seq.txt/.json: attention, gated_delta_rule quick sets
#   conformance   135 s  conformance.txt/.json: matmul rms_norm softmax token_logprobs quick sets (beside the other)
# Then 00-all.tgz holds every file (the device tool returns only the first few files of OUT, by name).
# Then summary.txt is printed again, so the call's output tail ends with it. log.txt: each stage's rc and time;
# perf_<stage>.txt: each python stage's own output.
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh
perf_setup "$0" gpu-check-out "$@"

if [ -z "$DRY" ]; then
  { nvidia-smi || true
    "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda); print(torch.cuda.get_device_name())"
  } > "$OUT/env.txt" 2>&1
fi

# each python stage stops itself a few seconds before the shell's limit
step perf-env 25 perf_env.txt "${PERF[@]}" --stage env ceilings --budget 10
step perf-ops-a 60 perf_ops_a.txt "${PERF[@]}" --stage ops --budget 50 \
  --only rms_norm softmax logsumexp token_logprobs
# the elementwise rows ride with linear: after attention they were starved by the 118 ms prefill row (2026-12-04)
step perf-ops-b 75 perf_ops_b.txt "${PERF[@]}" --stage ops --budget 63 --only linear/ silu_mul apply_rotary
step perf-ops-c 80 perf_ops_c.txt "${PERF[@]}" --stage ops --budget 68 --only attention gdn
step perf-profile 30 perf_profile.txt "${PERF[@]}" --stage profile --budget 20
step perf-ncu 40 perf_ncu.txt "${PERF[@]}" --stage ncu --budget 32
step perf-summary 15 perf_summary.txt "${PERF[@]}" --stage summary

if [ -n "$DRY" ]; then
  step conformance-parse 30 conformance_parse.txt "$PY" -m hal.cli conformance run --help
else
  # the two sets side by side: on a fresh machine their time is Triton compiling (CPU, 16 cores), not the GPU;
  # one after the other they did not finish cold on 2026-12-04 (85 s + 50 s), side by side warm in 29 s / 34 s
  step conformance-seq "${SEQ_CONF_TIMEOUT:-135}" conformance_seq.txt "$PY" -m hal.cli conformance run \
    --backend triton --device cuda --ops attention gated_delta_rule --quick --verbose --json "$OUT/conformance_seq.json" &
  step conformance "${CONF_TIMEOUT:-135}" conformance.txt "$PY" -m hal.cli conformance run --backend triton \
    --device cuda --ops matmul rms_norm softmax token_logprobs --quick --verbose --json "$OUT/conformance.json" &
  wait
fi
log "done"
# every file in one archive named to sort first: the device tool brings back only the first few files of $OUT
# (the members are named, not ".": archiving "." while 00-all.tgz grows in it made tar exit 1, "file changed")
( cd "$OUT" && find . -maxdepth 1 -type f ! -name 00-all.tgz -printf '%P\n' | sort \
    | tar -czf 00-all.tgz -T - ) || log "tar failed"
cat "$OUT/log.txt"
tail -n 6 "$OUT"/conformance*.txt 2>/dev/null
cat "$OUT/summary.txt" 2>/dev/null || echo "no summary.txt (the summary stage did not finish)"
