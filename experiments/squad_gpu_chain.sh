#!/usr/bin/env bash
# The whole SQuAD chain on a GPU machine with the accelerator recipe (experiments/squad.py), each
# stage resuming what a previous run finished: [teacher + its logits], train, dump, index, eval on
# SQuAD-open small (20,958 passages, all 10,570 dev questions), RC EM/F1 in W/results.json.
# Usage: bash experiments/squad_gpu_chain.sh W [--set key=value ...]
#   DISTILL=1 first trains the cross-encoder teacher (W/teacher) and distils from it; off by
#   default until distillation is shown to help (issue 21). On the lent H100 (../shared/gpu/):
#   PY=python3 bash experiments/squad_gpu_chain.sh /root/w/chain --set data.dir=/root/gpu/data/squad
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:?usage: squad_gpu_chain.sh WORKDIR [--set key=value ...]}; shift
PY=${PY:-.venv/bin/python}
C=(--config "${CONFIG:-experiments/squad.py}" --workdir "$W" --set train.progress_bar=False "$@")
stage() { echo "=== $(date -Is) $*"; "$PY" run.py "$@"; }
if [ "${DISTILL:-0}" = 1 ]; then
  stage teacher "${C[@]}"
  C+=(--set train.teacher_logits=teacher/logits)
fi
stage train "${C[@]}"
stage dump "${C[@]}"
stage index "${C[@]}" --set 'index.specs=["Flat"]'
stage eval "${C[@]}"
echo "=== $(date -Is) done: $W/results.json (RC), $W/open_eval_Flat.json (SQuAD-open small)"
