#!/usr/bin/env bash
# The whole SQuAD chain on a GPU machine with the accelerator recipe (experiments/squad.py), each
# stage resuming what a previous run finished: [teacher + its logits], train, dump, index, eval on
# SQuAD-open small (20,958 passages, all 10,570 dev questions), RC EM/F1 in W/results.json.
# Usage: bash experiments/squad_gpu_chain.sh W [--set key=value ...]
#   DISTILL=1 first trains the cross-encoder teacher (W/teacher) and distils from it; off by
#   default until distillation is shown to help (issue 21). On the lent H100 (../shared/gpu/):
#   PY=python3 bash experiments/squad_gpu_chain.sh /root/w/chain --set data.dir=/root/gpu/data/squad
#   HARD_NEGATIVES=1 then mines hard negatives of every training question with W's model and
#   index (`run.py mine`: top-10 phrases, passages without an answer; the exact index is searched
#   on the GPU) and runs the same chain again in W-hn with h = 1 mined passage per example
#   (Kim et al.; at the CPU budget they raised passage Top-1 50.1 -> 55.1, results/peers.md).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:?usage: squad_gpu_chain.sh WORKDIR [--set key=value ...]}; shift
PY=${PY:-.venv/bin/python}
stage() { echo "=== $(date -Is) $*"; "$PY" run.py "$@"; }
if [ "${HARD_NEGATIVES:-0}" = 1 ]; then  # refused by training only after the first chain's time
  for arg in "$@"; do
    case "$arg" in train.questions_per_window=[2-9]*|train.questions_per_window=[1-9][0-9]*)
      echo "HARD_NEGATIVES=1 needs one question per window; $arg (passage-grouped batches)" \
           "does not take hard negatives" >&2; exit 2;;
    esac
  done
fi
chain() {  # chain WORKDIR [--set ...]: [teacher,] train, dump, index, eval
  local C=(--config "${CONFIG:-experiments/squad.py}" --workdir "$1" --set train.progress_bar=False
           "${@:2}")
  if [ "${DISTILL:-0}" = 1 ]; then
    stage teacher "${C[@]}"
    C+=(--set train.teacher_logits=teacher/logits)
  fi
  stage train "${C[@]}"
  stage dump "${C[@]}"
  stage index "${C[@]}" --set 'index.specs=["Flat"]'
  stage eval "${C[@]}"
}
chain "$W" "$@"
echo "=== $(date -Is) done: $W/results.json (RC), $W/open_eval_Flat.json (SQuAD-open small)"
if [ "${HARD_NEGATIVES:-0}" = 1 ]; then
  [ -f "$W/hard_negatives.jsonl" ] || stage mine --config "${CONFIG:-experiments/squad.py}" \
      --workdir "$W" "$@"
  chain "$W-hn" "$@" --set "train.hard_negatives.file=$(cd "$W" && pwd)/hard_negatives.jsonl"
  echo "=== $(date -Is) done: $W-hn/results.json, $W-hn/open_eval_Flat.json (+ hard negatives)"
fi
