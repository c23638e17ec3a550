# Shared by the GPU / Ascend check scripts (sourced, not run): time-boxed steps that log to $OUT/log.txt.
#   STEPS="lint exact ..."   run only the named steps (default: every step), in the script's order
#   step NAME SECONDS OUTFILE CMD...   runs CMD with a limit, stdout+stderr to $OUT/OUTFILE; a failing
#                                      or timed-out step is logged and the next one runs
# Callers set OUT first.

log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt"; }

wanted() {  # wanted NAME: is this step selected by STEPS?
  [ -z "${STEPS:-}" ] && return 0
  case " $STEPS " in *" $1 "*) return 0 ;; esac
  return 1
}

step() {
  local name=$1 secs=$2 file=$3; shift 3
  if ! wanted "$name"; then log "skip $name (not in STEPS)"; return 0; fi
  log "start $name (limit ${secs}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$OUT/$file" 2>&1
  local rc=$?
  log "end $name rc=$rc ($((SECONDS - t0))s)$([ $rc = 124 ] && echo ' TIMED OUT')"
}

# The start of the gpu_perf scripts (gpu_check_8min.sh, gpu_sweep.sh): perf_setup SCRIPT DEFAULT_OUT [--dry-run]
# [OUT_DIR] sets DRY, OUT (made; else $OUT, else DEFAULT_OUT), PY and PERF, the benchmarks.gpu_perf command: on the GPU, or with
# --dry-run on the CPU (bash -n SCRIPT first, then the Triton interpreter at tiny shapes).
perf_setup() {
  local script=$1 default_out=$2; shift 2
  DRY=""
  if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
  OUT="${1:-${OUT:-$default_out}}"
  mkdir -p "$OUT"
  PY="${PYTHON:-python}"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  if [ -n "$DRY" ]; then
    bash -n "$script" && log "bash -n ok"
    export TRITON_INTERPRET=1
    PERF=("$PY" -m benchmarks.gpu_perf --device cpu --tiny --out "$OUT")
  else
    unset TRITON_INTERPRET
    PERF=("$PY" -m benchmarks.gpu_perf --device cuda --out "$OUT")
  fi
}

# The device call's budget (issue 49): plan_check CALL_S RESERVE_S GROUP...: each GROUP is a quoted list of
# "stage:seconds" run side by side; the groups run one after the other. The stage limits (a group counts its
# largest) plus RESERVE_S (the tail: archive, prints, the kill-after grace of a stage that ignores TERM) must add
# up within the CALL_S call, or the script stops before running anything. Sets each stage's limit for `limit`.
plan_check() {
  local call=$1 reserve=$2 total g s name secs max; shift 2
  total=$reserve
  for g in "$@"; do
    max=0
    for s in $g; do
      name=${s%%:*}; secs=${s##*:}
      printf -v "LIMIT_${name//-/_}" '%s' "$secs"
      [ "$secs" -gt "$max" ] && max=$secs
    done
    total=$((total + max))
  done
  if [ "$total" -gt "$call" ]; then
    log "PLAN OVER BUDGET: stage limits + ${reserve}s reserve = ${total}s > the ${call}s call"
    return 1
  fi
  log "plan ok: stage limits + ${reserve}s reserve = ${total}s <= the ${call}s call"
}

limit() {  # limit STAGE: its seconds from plan_check (a stage missing from the plan is an error)
  local v="LIMIT_${1//-/_}"
  echo "${!v:?stage $1 is not in the plan}"
}
