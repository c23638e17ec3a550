#!/usr/bin/env bash
# The ascend backend on a real Ascend NPU (Atlas A2/A3), in one go. Nothing is installed: the machine
# needs CANN (set_env.sh sourced), torch_npu and triton-ascend (NOT community triton) already.
#
#   bash benchmarks/ascend_check.sh OUT_DIR
#
# Writes to OUT_DIR: env.txt (versions, `hal info`), lint.txt (API subset of the Ascend variant),
# math.txt (strict math on the NPU vs the reference bits), conformance.json / conformance.txt
# (--backend ascend --device npu against the stored goldens), bench.csv / bench.txt (vs stock torch /
# torch_npu ops, npu_fusion_attention for attention), rl_parity.txt (examples.rl_parity --device npu), log.txt. Every step is
# time-boxed; a failing step is logged, the next one runs; STEPS="lint math ..." runs only the named steps.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-ascend-check-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
# conformance suites to run (SUITES; FAMILIES, its older name, is still read)
SUITES="${SUITES:-${FAMILIES:-matmul rms_norm softmax token_logprobs elementwise rotary attention gated_delta_rule gdn_layer}}"
CONF_ARGS="${CONF_ARGS:-}"          # e.g. --quick
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
# determinism a user also needs (docs/ascend.md): deterministic aclnn kernels for the stock side and
# any torch op around lockstep's, deterministic HCCL reductions for multi-device runs
export HCCL_DETERMINISTIC="${HCCL_DETERMINISTIC:-true}"

# shellcheck source=benchmarks/check_steps.sh
source benchmarks/check_steps.sh

{ npu-smi info || true
  "$PY" -c "import sys, torch, torch_npu; from importlib import metadata as m; print(sys.version); print('torch', torch.__version__, 'torch_npu', torch_npu.__version__); print('triton package owned by', m.packages_distributions().get('triton'))"
  "$PY" -m hal.cli info
} > "$OUT/env.txt" 2>&1

step lint 60 lint.txt "$PY" -m hal.kernels.checks.ascend_lint
step math 300 math.txt "$PY" tests/scripts/ascend_npu_math_check.py
# shellcheck disable=SC2086
step conformance "${CONF_TIMEOUT:-900}" conformance.txt "$PY" -m hal.cli conformance run --backend ascend \
  --device npu --ops $SUITES $CONF_ARGS --json "$OUT/conformance.json"
step bench "${BENCH_TIMEOUT:-600}" bench.txt "$PY" -m benchmarks.ascend_bench --csv "$OUT/bench.csv"
# sampler vs trainer on the NPU (torch_npu imported first so that the npu device type exists): every op of
# the example now has an Ascend kernel (attention and the gated delta rule included), so it should run through
step rl_parity 300 rl_parity.txt "$PY" -c "import runpy, sys, torch_npu; sys.argv = ['examples.rl_parity', '--device', 'npu']; runpy.run_module('examples.rl_parity', run_name='__main__')"
log "done"
