#!/usr/bin/env bash
# The perf call (issues 40, 49): one prepared device call of at most 450 s, run on the still-warm machine after
# the verification call (benchmarks/gpu_verify.sh, <= 150 s: fast's and exact's conformance, the bits sweep,
# fast_bench's bits rows). It measures and diagnoses every op, then runs the strict GPU conformance quick sets.
# gpu_check.sh keeps the longer steps for a longer lease. Nothing is installed; no network.
#
#   bash benchmarks/gpu_check_8min.sh OUT_DIR          (the device call's timeout_s = 450)
#   bash benchmarks/gpu_check_8min.sh --dry-run OUT    (CPU: bash -n, the plan's sum, the same stages on CPU stand-ins)
#
# Stages (each its own process and limit, so a stage that runs out keeps its rows and the next one runs;
# every python stage also stops itself at its --budget, a few seconds earlier). The plan (plan_check below)
# adds the limits up, plus a 20 s reserve, within the 450 s call before anything runs (2026-12-04d's times
# in brackets, H200, the 480 s layout):
#   perf-env      15 s   env.json, ceilings.jsonl: versions; copy bandwidth, bf16 / fp32 (TF32 off) matmul [7 s]
#   perf-ops-a    55 s   ops.jsonl, ops.csv, kernels.jsonl: rms_norm, softmax family, token_logprobs (strict) vs
#                        stock, CUDA-graph replay over rotated input sets [43 s]; the fast token_logprobs rows
#                        (token_logprobs/fast/N8-256) do not fit its budget: a full gpu_perf run measures them
#   perf-ops-b    90 s   the same files: linear, decode rows 1-256 and prefill 2k / 8k, strict / fast / exact;
#                        silu_mul, apply_rotary [47 s, before the fast-v2 rows]
#   perf-ops-c    80 s   the same files: paged decode / prefill attention (strict, fast), GDN decode / chunked [74 s];
#                        the decode-tile spec's rows (attention_*/fast-m16/*) do not fit: gpu_sweep.sh's first stage
#   perf-profile  25 s   profile.jsonl, profile.txt: torch.profiler of the 4 worst rows [22 s]
#   perf-ncu      35 s   ncu.jsonl, ncu_0.csv: Nsight Compute on the 3 worst kernels (absent / failing: logged) [36 s]
#   perf-summary  10 s   summary.jsonl, summary.txt: every row (a planned row never measured: "not run"), then the
#                        symptoms of each slow row [4 s]
#   conformance-seq 110 s conformance_seq.txt/.json: attention, gated_delta_rule quick sets [69 s cold]
#   conformance   110 s  conformance.txt/.json: matmul rms_norm softmax token_logprobs quick sets (beside the other)
#                        [47 s cold]
# A later issue's rows name the stage they displace, or go in an alternate perf script (gpu_sweep.sh; gpu_exact.sh,
# the exact policy's fast path) run once this one has a complete run on record.
# Then 00-all.tgz holds every file (the device tool returns only the first few files of OUT, by name).
# Then summary.txt is printed again, so the call's output tail ends with it. log.txt: each stage's rc and time;
# perf_<stage>.txt: each python stage's own output.
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh
perf_setup "$0" gpu-check-out "$@"
plan_check 450 20 "perf-env:15" "perf-ops-a:55" "perf-ops-b:90" "perf-ops-c:80" "perf-profile:25" "perf-ncu:35" \
  "perf-summary:10" "conformance-seq:${SEQ_CONF_TIMEOUT:-110} conformance:${CONF_TIMEOUT:-110}" || exit 1

if [ -z "$DRY" ]; then
  { nvidia-smi || true
    "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda); print(torch.cuda.get_device_name())"
  } > "$OUT/env.txt" 2>&1
fi

# each python stage stops itself a few seconds before the shell's limit
step perf-env "$(limit perf-env)" perf_env.txt "${PERF[@]}" --stage env ceilings --budget 8
step perf-ops-a "$(limit perf-ops-a)" perf_ops_a.txt "${PERF[@]}" --stage ops --budget 46 \
  --only rms_norm softmax logsumexp token_logprobs/strict
# the elementwise rows ride with linear: after attention they were starved by the 118 ms prefill row (2026-12-04)
step perf-ops-b "$(limit perf-ops-b)" perf_ops_b.txt "${PERF[@]}" --stage ops --budget 78 --only linear/ silu_mul \
  apply_rotary
step perf-ops-c "$(limit perf-ops-c)" perf_ops_c.txt "${PERF[@]}" --stage ops --budget 68 --only attention gdn \
  --skip fast-m16
step perf-profile "$(limit perf-profile)" perf_profile.txt "${PERF[@]}" --stage profile --budget 17
step perf-ncu "$(limit perf-ncu)" perf_ncu.txt "${PERF[@]}" --stage ncu --budget 28
step perf-summary "$(limit perf-summary)" perf_summary.txt "${PERF[@]}" --stage summary

if [ -n "$DRY" ]; then
  step conformance-parse 30 conformance_parse.txt "$PY" -m hal.cli conformance run --help
else
  # the two sets side by side: on a fresh machine their time is Triton compiling (CPU, 16 cores), not the GPU;
  # one after the other they did not finish cold on 2026-12-04 (85 s + 50 s), side by side warm in 29 s / 34 s
  step conformance-seq "$(limit conformance-seq)" conformance_seq.txt "$PY" -m hal.cli conformance run \
    --backend triton --device cuda --ops attention gated_delta_rule --quick --verbose --json "$OUT/conformance_seq.json" &
  step conformance "$(limit conformance)" conformance.txt "$PY" -m hal.cli conformance run --backend triton \
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
