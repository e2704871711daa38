#!/usr/bin/env bash
# Issue 21's recipe study at the CPU budget (experiments/squad.py:cpu-base: the same configs, steps
# and seed as on the CPU), run on a lent GPU machine, where a run takes minutes instead of ~75:
#   1. the factor runs of experiments/studies/recipe_runs.sh, two at a time (each process may take
#      45% of the GPU's memory: XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 from ../shared/gpu's setup);
#   2. the baseline's full SQuAD-open small dump and Flat index, and its subcorpora C0 / H32 for a
#      random 2,000 dev questions (`run.py subcorpus`);
#   3. H32 and full-corpus EM@1 of the baseline and the two runs with the best RC EM
#      (experiments/studies/validation_experiment.py -> R/validation_recipe.{json,md}).
# The small results (results.json, rc_predictions.json, metrics.jsonl of every run and teacher,
# the validation report) are copied to COPY after every stage; every stage resumes.
# Usage, on the GPU machine after ../shared/gpu/README.md's setup (its exports in the shell):
#   PY=python3 SET="--set data.dir=/root/gpu/data/squad" \
#     bash experiments/studies/recipe_gpu.sh /root/w/recipe /root/w/copy [NAME ...]
# then, here, with COPY brought back: python experiments/studies/recipe_study.py ... --validation
#   COPY/validation_recipe.json (its docstring) -> results/recipe.{md,json}.
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${1:?usage: recipe_gpu.sh RUNS_DIR COPY_DIR [NAME ...]}
COPY=${2:?usage: recipe_gpu.sh RUNS_DIR COPY_DIR [NAME ...]}
shift 2
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(base grouped3 distill grouped3-distill scale2 inb4 prb0 dropout len256
                                 lr5e-5 lr2e-4 scale0.5 prb4 warm0.2 warm0.02 len128)
export PY=${PY:-python3} SET=${SET:-} OUT=$R CONFIG=${CONFIG:-experiments/squad.py:cpu-base}
C=(--config "$CONFIG" --workdir "$R/base" --set train.progress_bar=False $SET)
mkdir -p "$R" "$COPY"

copy() {
  for d in "$R"/*/ "$R"/*/teacher/; do
    [ -f "$d/metrics.jsonl" ] || continue
    to="$COPY/${d#"$R"/}"
    mkdir -p "$to"
    cp "$d"/{results.json,rc_predictions.json,metrics.jsonl} "$to" 2>/dev/null
  done
  cp "$R"/validation_recipe.* "$COPY" 2>/dev/null
  return 0
}

echo "=== $(date -Is) runs: ${NAMES[*]} ($(git rev-parse --short HEAD 2>/dev/null))"
printf '%s\n' "${NAMES[@]}" | xargs -P 2 -I{} bash experiments/studies/recipe_runs.sh {}
copy
[ -f "$R/base/results.json" ] || { echo "the baseline did not finish"; exit 1; }

echo "=== $(date -Is) the baseline's dump, index and subcorpora"
$PY run.py dump "${C[@]}" && $PY run.py index "${C[@]}" --set 'index.specs=["Flat"]' &&
  $PY run.py subcorpus "${C[@]}" --set validation.sample_questions=2000 \
      --set 'validation.kinds=["C0","H32"]' || exit $?

# The two runs (besides the baseline) with the best RC EM.
best=$($PY - "$R" <<'EOF'
import json, pathlib, sys
runs = [(json.loads(p.read_text())["rc_exact_match"], p.parent.name)
        for p in pathlib.Path(sys.argv[1]).glob("*/results.json") if p.parent.name != "base"]
print(" ".join(name for _, name in sorted(runs, reverse=True)[:2]))
EOF
)
models=(--model "base=$R/base")
for name in $best; do models+=(--model "$name=$R/$name" --compare "$name:base"); done
echo "=== $(date -Is) H32 / full-corpus EM@1: base $best"
$PY experiments/studies/validation_experiment.py --config "$CONFIG" $SET \
    --subcorpora "$R/base/subcorpora" \
    "${models[@]}" --out "$R/validation_recipe.json" || exit $?
copy
echo "=== $(date -Is) done: $COPY"
