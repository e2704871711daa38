#!/usr/bin/env bash
# Issue 21's full-scale choice on a lent GPU machine: candidate accelerator recipes
# (experiments/squad.py, batch 48 windows x 384, the default's seed) trained two at a time, each
# with its RC EM/F1 on all 10,570 dev questions; then the whole chain (dump, Flat index, SQuAD-open
# small eval: EM@1/EM@10, passage Top-1/5/20) for the candidate with the best RC EM
# (experiments/squad_gpu_chain.sh with that candidate's settings; HARD_NEGATIVES=1 passes on to
# it: mining and a second chain with hard negatives). Small results (results.json,
# rc_predictions.json, metrics.jsonl, open_eval_*.json) are copied to COPY after every stage;
# every stage resumes what a previous run finished.
# Usage, on the GPU machine after ../shared/gpu/README.md's setup (its exports in the shell):
#   PY=python3 SET="--set data.dir=/root/gpu/data/squad" \
#     bash experiments/studies/recipe_gpu_full.sh /root/w/full /root/w/copy [NAME ...]
# NAME: runs of experiments/studies/recipe_runs.sh (default: base fp32 nodrop grouped5
# grouped5-e4; `base` is the shipped default (bfloat16 compute since it matched float32 at the CPU
# budget), `fp32` the same in float32, its check at full scale; `nodrop` the same without dropout,
# which cost 5 RC EM at the CPU budget).
# Expected cost on an H100: ~3 min a 2-epoch candidate alone (two at a time: ~13 min for the five),
# the chain ~5-10 min (the Flat eval of 10,570 questions searched on the GPU: DeviceFlat).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${DISTILL:-0}" = 1 ]; then  # the chain would resume a candidate trained without a teacher
  echo "recipe_gpu_full.sh: DISTILL=1 is for experiments/squad_gpu_chain.sh on a new workdir;" \
       "the candidates here train without a teacher" >&2
  exit 2
fi
R=${1:?usage: recipe_gpu_full.sh RUNS_DIR COPY_DIR [NAME ...]}
COPY=${2:?usage: recipe_gpu_full.sh RUNS_DIR COPY_DIR [NAME ...]}
shift 2
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(base fp32 nodrop grouped5 grouped5-e4)
export PY=${PY:-python3} SET=${SET:-} OUT=$R CONFIG=${CONFIG:-experiments/squad.py}
mkdir -p "$R" "$COPY"

copy() {
  for d in "$R"/*/; do
    [ -f "$d/metrics.jsonl" ] || continue
    to="$COPY/$(basename "$d")"
    mkdir -p "$to"
    cp "$d"/{results.json,rc_predictions.json,metrics.jsonl} "$d"/open_eval_*.json "$to" 2>/dev/null
  done
  return 0
}

echo "=== $(date -Is) candidates: ${NAMES[*]} ($(git rev-parse --short HEAD 2>/dev/null))"
printf '%s\n' "${NAMES[@]}" | xargs -P 2 -I{} bash experiments/studies/recipe_runs.sh {}
copy
best=$($PY - "$R" "${NAMES[@]}" <<'EOF'
import json, pathlib, sys
root, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = [(json.loads((root / n / "results.json").read_text())["rc_exact_match"], n)
        for n in names if (root / n / "results.json").is_file()]
print(max(runs)[1] if runs else "")
EOF
)
[ -n "$best" ] || { echo "no candidate finished"; exit 1; }
echo "=== $(date -Is) chain for the best RC EM: $best"
# shellcheck disable=SC2086  # the run's --set arguments, word-split on purpose
settings=$(bash experiments/studies/recipe_runs.sh --settings "$best")
bash experiments/squad_gpu_chain.sh "$R/$best" $settings $SET || exit $?
copy
echo "=== $(date -Is) done: $COPY ($best: results.json, open_eval_Flat.json)"
