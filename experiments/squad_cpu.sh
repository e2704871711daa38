#!/usr/bin/env bash
# The CPU-budget SQuAD runs of results/squad_rc.md (squad.py:cpu, 1,500 steps): both recipes,
# one after the other; a rerun resumes each from its last checkpoint.
# Usage: nohup bash experiments/squad_cpu.sh > logs/squad_cpu.log 2>&1 &
#    or side by side, one core each (how results/squad_rc.md ran them):
#        RECIPES=unified nohup taskset -c 0 bash experiments/squad_cpu.sh > logs/squad_cpu_unified.log 2>&1 &
#        RECIPES=original nohup taskset -c 1 bash experiments/squad_cpu.sh > logs/squad_cpu_original.log 2>&1 &
# SET adds overrides to every run, e.g. SET="--set train.loss.lambda_inb=256" (the unified row of
# results/squad_rc.md, as `:cpu` was then).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for recipe in ${RECIPES:-unified original}; do
  /usr/bin/time -v $PY run.py train --config experiments/squad.py:cpu-base \
      --workdir workdirs/squad-cpu1500-$recipe --set train.loss.recipe=$recipe \
      --set train.progress_bar=False ${SET:-}
done
