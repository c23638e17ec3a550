#!/usr/bin/env bash
# One RL step end to end on the GPU (benchmarks/gpu_rl_step.py, issue 51): transformers' continuous-batching engine
# samples, a micro-batched teacher-forced trainer computes the log-probs, a GRPO-style loss and its backward; lockstep
# and stock in the same run, the recorded log-prob bits compared. An alternate perf script for a lent GPU's time
# (like benchmarks/gpu_sweep.sh): one call of at most 5 minutes. Nothing installed; no network (the image's torch,
# Triton and transformers 5.17, a release whose continuous-batching engine lockstep's tests run on: CI's vLLM
# environment; docs/integrations.md, "Which transformers releases").
#
#   bash benchmarks/gpu_rl_step.sh OUT_DIR          (the device call's timeout_s = 300)
#   bash benchmarks/gpu_rl_step.sh --dry-run OUT    (CPU: the same code at tiny shapes)
#
# On CUDA lockstep runs under lt.patch(model, policy="fast") (the issue's target: <= 1.15x of stock); POLICY=strict
# runs the strict kernels instead (smaller sizes). The CPU dry run is strict (lockstep's CPU kernels, as the tests).
# rl_step.txt: the table (tokens/s per phase and step, lockstep / stock ratios, log-prob bits differing, peak memory).
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh
perf_setup "$0" gpu-rl-step-out "$@"
if [ -n "$DRY" ]; then
  POLICY="${POLICY:-strict}"
  unset TRITON_INTERPRET  # the tiny CPU run uses lockstep's CPU kernels, as the tests do
  RL=("$PY" -m benchmarks.gpu_rl_step --device cpu --tiny --out "$OUT" --policy "$POLICY")
else
  POLICY="${POLICY:-fast}"
  RL=("$PY" -m benchmarks.gpu_rl_step --device cuda --out "$OUT" --policy "$POLICY")
fi
step rl-env 20 rl_env.txt "$PY" -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
step rl-step 260 rl_step.txt "${RL[@]}" --budget 240
log "done"
cat "$OUT/log.txt"
cat "$OUT/rl_env.txt" "$OUT/rl_step.txt" 2>/dev/null
