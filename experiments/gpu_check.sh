#!/usr/bin/env bash
# The full-scale check on a lent GPU machine, after ../shared/gpu/README.md's setup:
# experiments/gpu_check.py with that machine's paths (weights and wheels under /root/site, SQuAD
# under /root/gpu/data/squad); results in $OUT/gpu_check.json (rendered afterwards by
# `python experiments/report.py gpu_check OUT/gpu_check.json`); the stages' logs and each
# candidate's small outputs (metrics.jsonl, RC and open-domain predictions and run files, for
# paired tests here) in $OUT/runs.tgz: the device tool brings back at most 8 files.
# Usage: OUT=/path bash experiments/gpu_check.sh [gpu_check.py arguments, e.g. --alt NAME=ARGS]
#        OUT=/path bash experiments/gpu_check.sh --pack-only   (runs.tgz of what $W holds now)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${W:-/root/w/check}
# XLA's autotuning results, which JAX keeps in the compilation cache's AUTOTUNED folder: an
# earlier run's (AUTOTUNE, a tarball the device tool brought back and the tree now carries) are
# unpacked there first, so compiles skip the autotuning they cover; this run's go back as
# $OUT/autotune.tgz. gpu_check.json counts the results found at the start.
export DPJAX_COMPILATION_CACHE=${DPJAX_COMPILATION_CACHE:-$HOME/.cache/dpjax/xla}
AUTOTUNED=xla_gpu_per_fusion_autotune_cache_dir
AUTOTUNE=${AUTOTUNE:-workdirs/gpu_autotune/autotune.tgz}

pack() {
  local small=(metrics.jsonl results.json rc_predictions.json open_eval_Flat.json
               open_predictions_Flat.jsonl open_run_Flat.trec open_eval_Flat_hybrid.json
               open_predictions_Flat_hybrid.jsonl open_run_Flat_hybrid.trec)
  tar czf "${OUT:?set OUT}/runs.tgz" -C "$W" logs $(cd "$W" && for f in "${small[@]}"; do
    ls -d */"$f"; done 2>/dev/null)
  local packed=$?
  if [ -d "$DPJAX_COMPILATION_CACHE/$AUTOTUNED" ]; then
    tar czf "$OUT/autotune.tgz" -C "$DPJAX_COMPILATION_CACHE" "$AUTOTUNED"
  fi
  return $packed
}

if [ "${1:-}" = --pack-only ]; then
  pack
  exit $?
fi
if [ -f "$AUTOTUNE" ]; then
  mkdir -p "$DPJAX_COMPILATION_CACHE" && tar xzf "$AUTOTUNE" -C "$DPJAX_COMPILATION_CACHE" "$AUTOTUNED"
fi
# The default alone gets the GPU's memory; with an --alt candidate two processes share it.
FRACTION=0.9
for arg in "$@"; do [[ $arg == --alt* ]] && FRACTION=0.45; done
export PYTHONPATH=/root/site:$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=$FRACTION PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
python3 experiments/gpu_check.py --workdir "$W" --out "$W/logs" --json "${OUT:?set OUT}/gpu_check.json" \
  --set data.dir=/root/gpu/data/squad "$@"
rc=$?
pack
exit $rc
