#!/usr/bin/env bash
# Runs a learner job as N ranks on this host, the way torchrun --standalone does: one process per
# rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT. The ranks'
# output goes to <log-dir>/rank<R>.log (rank 0's also to this terminal). If one rank fails, the
# others are stopped; the exit code is the first failing rank's.
#
#   scripts/launch/local.sh --ranks 2 [--log-dir DIR] -- build/trainer/opd-trainer sft --config C
#   scripts/launch/local.sh --ranks 4 -- build/teacher_service/opd-teacher --model DIR  (expert-parallel)
set -euo pipefail

ranks=""
log_dir=""
while (($#)); do
  case "$1" in
    --ranks) ranks="$2"; shift 2 ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    --help | -h) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) echo "local.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$ranks" =~ ^[1-9][0-9]*$ ]]; then
  echo "local.sh: --ranks N (a positive number) is required" >&2
  exit 2
fi
if (($# == 0)); then
  echo "local.sh: no command after --" >&2
  exit 2
fi
log_dir=${log_dir:-$(mktemp -d -t opd-ranks.XXXXXX)}
mkdir -p "$log_dir"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
stop_all() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap 'stop_all' INT TERM
for ((r = 0; r < ranks; r++)); do
  RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$@" >"$log_dir/rank$r.log" 2>&1 &
  pids+=($!)
done
echo "local.sh: $ranks rank(s) on 127.0.0.1:$port, logs in $log_dir" >&2
tail -n +1 -f "$log_dir/rank0.log" --pid "${pids[0]}" >&2 &
tailer=$!

# The first rank to fail stops the others (they would otherwise wait out their collective
# timeout); a rank killed by a signal counts as failed.
status=0
remaining=$ranks
while ((remaining > 0)); do
  rc=0
  wait -n -p finished || rc=$?
  [ "${finished:-}" = "$tailer" ] && continue
  remaining=$((remaining - 1))
  if ((rc != 0 && status == 0)); then
    status=$rc
    stop_all
  fi
done
wait "$tailer" 2>/dev/null || true
exit "$status"
