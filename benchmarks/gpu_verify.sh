#!/usr/bin/env bash
# The verification call (issue 49): the first device call of a lent GPU, at most 150 s, before the perf call
# (gpu_check_8min.sh, <= 450 s, on the still-warm machine). It checks fast's and exact's claims on the device:
#
#   bash benchmarks/gpu_verify.sh OUT_DIR          (the device call's timeout_s = 150)
#   bash benchmarks/gpu_verify.sh --dry-run OUT    (CPU: bash -n, the plan's sum, every stage's code on CPU stand-ins)
#
# Stages (each its own process and limit; a group's stages run side by side, the groups one after the other; the
# plan below must add up within the call, checked before anything runs):
#   verify-env            env.txt: nvidia-smi, versions
#   conf-matmul-fast      conformance_matmul_fast.txt/.json: matmul_fast quick set, triton backend
#   conf-attention-fast   conformance_attention_fast.txt/.json: attention_fast quick set, triton backend
#   conf-matmul-exact     conformance_matmul_exact.txt/.json: matmul_exact quick set, triton backend (it serves the
#                         exact policy since issue 53's first part: the backend an exact call takes on CUDA)
#   conf-gdn-fast         conformance_gdn_fast.txt/.json: gated_delta_rule_fast quick set, triton backend (issue
#                         50; side by side with the three above, so it adds no time to the plan: it shares their
#                         105 s and the machine's 16 cores)
#   conf-tlp-fast         conformance_tlp_fast.txt/.json: token_logprobs_fast quick set (3 small cases), triton
#                         backend (issue 49 item 4; side by side as conf-gdn-fast: no time added to the plan)
#   bits-sweep            bits_sweep.txt, bits_sweep.jsonl: benchmarks/fast_bits_sweep.py (which launch choices
#                         change a tensor-core dot's float32 accumulator; split-K negative control must be caught)
#   fast-bench-bits       fast_bench_bits.txt, fast_bench.csv: benchmarks/fast_bench.py's raw-bit rows (rows
#                         alone vs in batches of 1..4096; cuBLAS as negative control, which must differ)
# Every conformance stage passes --require-claims: it fails unless the backend claims levels of the suite on the
# device and every claimed level compared at least one case (the report prints the cases per suite and level).
# The call FAILS (exit 1) unless every stage ended rc=0; a stage not reached prints "not run", never "same".
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh
perf_setup "$0" gpu-verify-out "$@"
plan_check 150 10 "verify-env:10" \
  "conf-matmul-fast:105 conf-attention-fast:105 conf-matmul-exact:105 conf-gdn-fast:105 conf-tlp-fast:105 bits-sweep:105" \
  "fast-bench-bits:25" || exit 1

if [ -z "$DRY" ]; then
  DEV=(--device cuda); SWEEP=(); BENCH=(); PLAN=()
  step verify-env "$(limit verify-env)" env.txt bash -c 'nvidia-smi; "$0" -c "import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"cuda\", torch.version.cuda); print(torch.cuda.get_device_name())"' "$PY"
else
  # CPU stand-ins: the interpreter. matmul_fast's quick set runs (bf16); attention_fast's, the exact set's, the
  # fast GDN's and fast token_logprobs' take minutes on CPU (tests/test_triton_interpreter.py runs them), so their
  # stages run --plan (the same suite names, claims and device refusals, nothing run)
  DEV=(--device cpu); SWEEP=(--tiny); BENCH=(--tiny); PLAN=(--plan)
  step verify-env "$(limit verify-env)" env.txt "$PY" -c "import sys, torch, triton; print(sys.version, torch.__version__, triton.__version__, 'CPU dry run')"
fi
CONF=("$PY" -m hal.cli conformance run "${DEV[@]}" --quick --verbose --require-claims)
if [ -n "$DRY" ]; then
  step conf-matmul-fast "$(limit conf-matmul-fast)" conformance_matmul_fast.txt "${CONF[@]}" --backend triton \
    --ops matmul_fast --dtypes bf16 --json "$OUT/conformance_matmul_fast.json" &
else
  step conf-matmul-fast "$(limit conf-matmul-fast)" conformance_matmul_fast.txt "${CONF[@]}" --backend triton \
    --ops matmul_fast --json "$OUT/conformance_matmul_fast.json" &
fi
step conf-attention-fast "$(limit conf-attention-fast)" conformance_attention_fast.txt "${CONF[@]}" "${PLAN[@]}" \
  --backend triton --ops attention_fast --json "$OUT/conformance_attention_fast.json" &
step conf-matmul-exact "$(limit conf-matmul-exact)" conformance_matmul_exact.txt "${CONF[@]}" "${PLAN[@]}" \
  --backend triton --ops matmul_exact --json "$OUT/conformance_matmul_exact.json" &
step conf-gdn-fast "$(limit conf-gdn-fast)" conformance_gdn_fast.txt "${CONF[@]}" "${PLAN[@]}" \
  --backend triton --ops gated_delta_rule_fast --json "$OUT/conformance_gdn_fast.json" &
step conf-tlp-fast "$(limit conf-tlp-fast)" conformance_tlp_fast.txt "${CONF[@]}" "${PLAN[@]}" \
  --backend triton --ops token_logprobs_fast --json "$OUT/conformance_tlp_fast.json" &
step bits-sweep "$(limit bits-sweep)" bits_sweep.txt "$PY" -m benchmarks.fast_bits_sweep "${SWEEP[@]}" --out "$OUT" \
  --budget $(( $(limit bits-sweep) - 10 )) &
wait
step fast-bench-bits "$(limit fast-bench-bits)" fast_bench_bits.txt "$PY" -m benchmarks.fast_bench --bits-only \
  "${BENCH[@]}" --csv "$OUT/fast_bench.csv"
log "done"

# the verdict: every stage rc=0, or the stages that were not reached / failed, by name
for s in verify-env conf-matmul-fast conf-attention-fast conf-matmul-exact conf-gdn-fast conf-tlp-fast bits-sweep \
    fast-bench-bits; do
  line=$(grep -E "end $s rc=" "$OUT/log.txt" | tail -n 1)
  if [ -z "$line" ]; then echo "$s: not run"
  elif ! grep -q "rc=0 " <<< "$line"; then echo "$s: FAILED (${line#*] })"
  else echo "$s: ok"; fi
done > "$OUT/verdict.txt"
VERDICT=0
grep -q -v ": ok$" "$OUT/verdict.txt" && VERDICT=1
( cd "$OUT" && find . -maxdepth 1 -type f ! -name 00-all.tgz -printf '%P\n' | sort \
    | tar -czf 00-all.tgz -T - ) || log "tar failed"
cat "$OUT/log.txt"
for f in "$OUT"/conformance_*.txt; do echo "== $f"; grep -E "^(plan|  [a-z]+ +[a-z_]+ +L0|OK|FAILED)" "$f"; done
tail -n 20 "$OUT/bits_sweep.txt" 2>/dev/null
cat "$OUT/fast_bench_bits.txt" 2>/dev/null
cat "$OUT/verdict.txt"
echo "verification: $([ $VERDICT = 0 ] && echo 'every stage ok' || echo FAILED)"
exit $VERDICT
