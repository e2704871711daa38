#!/usr/bin/env bash
# The CPU-budget SQuAD runs of results/squad_rc.md (squad.py:cpu, 1,500 steps): both recipes,
# one after the other; a rerun resumes each from its last checkpoint.
# Usage: nohup bash experiments/squad_cpu.sh > logs/squad_cpu.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for recipe in ${RECIPES:-unified original}; do
  /usr/bin/time -v $PY run.py train --config experiments/squad.py:cpu \
      --workdir workdirs/squad-cpu1500-$recipe --set train.loss.recipe=$recipe \
      --set train.progress_bar=False
done
