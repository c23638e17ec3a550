# Shared by gpu_check.sh and ascend_check.sh (sourced, not run): time-boxed steps that log to $OUT/log.txt.
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
