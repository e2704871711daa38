#!/usr/bin/env bash
# The CPU-budget SQuAD runs of results/squad_rc.md: both recipes, one after the other.
# Usage: nohup bash experiments/squad_cpu.sh > logs/squad_cpu.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for recipe in ${RECIPES:-unified original}; do
  /usr/bin/time -v $PY run.py train --config experiments/squad.py:cpu \
      --workdir workdirs/squad-cpu-$recipe --set train.loss.recipe=$recipe \
      --set train.progress_bar=False
done
