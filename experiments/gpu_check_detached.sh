#!/usr/bin/env bash
# experiments/gpu_check.sh detached from the device command, for a check longer than one
# command's time limit: `start` launches it (setsid nohup; its JSON and logs under $W.out) and
# waits up to WAIT seconds, `collect` (the next command, on the same warm machine) waits up to
# WAIT more. Each then copies what the check has written so far to $OUT (gpu_check.json,
# runs.tgz, autotune.tgz, the check's own log), so a command that ends before the check still
# brings back every finished stage; `collect` prints the check's exit status once it has one.
# Usage: OUT=$OUT bash experiments/gpu_check_detached.sh start WAIT [gpu_check.py arguments]
#        OUT=$OUT bash experiments/gpu_check_detached.sh collect WAIT
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: gpu_check_detached.sh start|collect WAIT [ARGS]} wait=${2:?seconds to wait}
shift 2
export W=${W:-/root/w/check}
inner=$W.out
case $mode in
  start)
    rm -rf "$inner" && mkdir -p "$inner"
    OUT=$inner setsid nohup bash -c 'bash experiments/gpu_check.sh "$@"; echo $? > "$OUT/rc"' \
      gpu_check "$@" > "$inner/check.log" 2>&1 < /dev/null &
    ;;
  collect)
    [ -d "$inner" ] || { echo "gpu_check_detached.sh: no check started ($inner)"; exit 2; } ;;
  *) echo "gpu_check_detached.sh: start or collect, not $mode"; exit 2 ;;
esac
end=$((SECONDS + wait))
while [ ! -f "$inner/rc" ] && [ $SECONDS -lt $end ]; do sleep 2; done
[ -f "$inner/rc" ] || OUT=$inner bash experiments/gpu_check.sh --pack-only  # (still running)
cp "$inner"/gpu_check.json "$inner"/runs.tgz "$inner"/check.log "$inner"/autotune.tgz \
  "${OUT:?set OUT}/" 2>/dev/null
if [ -f "$inner/rc" ]; then
  echo "gpu_check finished: exit status $(cat "$inner/rc")"
else
  echo "gpu_check still running after ${wait} s: collect again"
fi
tail -n 5 "$inner/check.log"
