#!/usr/bin/env bash
# The recipe study of issue 21 at the CPU budget (experiments/squad.py:cpu-base): one factor per
# run against the baseline, same seed, each into workdirs/recipe/<name>, one after the other (a run
# alone on both cores takes ~65 min + evaluation; two side by side on one core each are ~1.6x
# slower per run). Each run resumes from its last checkpoint; finished runs are skipped.
# Usage: bash experiments/studies/recipe_runs.sh [NAME ...]   (default: all, in this order)
#   OUT (workdirs/recipe), PY, CONFIG (experiments/squad.py:cpu-base) and SET (more --set
#   arguments, e.g. SET="--set data.dir=/root/gpu/data/squad") from the environment.
#   Run it from a worktree at a fixed commit: git worktree add /work/wt-study HEAD
#   `bash experiments/studies/recipe_runs.sh --settings NAME` prints NAME's --set arguments only.
# Then: python experiments/studies/recipe_study.py ... (its docstring) -> results/recipe.{md,json}.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-workdirs/recipe}
CONFIG=${CONFIG:-experiments/squad.py:cpu-base}
SET=${SET:-}
declare -A RUNS=(
  [base]=""
  [lr2e-4]="--set train.learning_rate=2e-4"
  [grouped3]="--set train.questions_per_window=3"
  [scale2]="--set train.loss.score_scale=2.0"
  [scale0.5]="--set train.loss.score_scale=0.5"
  [inb4]="--set train.loss.lambda_inb=4.0"
  [lr5e-5]="--set train.learning_rate=5e-5"
  [prb4]="--set train.loss.prebatch_size=4"
  [prb0]="--set train.loss.prebatch_size=0"
  [warm0.2]="--set train.warmup_fraction=0.2"
  [warm0.02]="--set train.warmup_fraction=0.02"
  [dropout]="--set train.dropout=True"
  [len128]="--set data.max_seq_length=128 --set data.doc_stride=48"
  [len256]="--set data.max_seq_length=256 --set data.doc_stride=96"
  [distill]="--set train.teacher_logits=teacher/logits"
  [grouped3-distill]="--set train.questions_per_window=3 --set train.teacher_logits=teacher/logits"
  # Up to 5 questions per window (~45 per step of 12 windows, ~3.7x the baseline's questions at
  # ~1.7x its step time), 2,000 steps: the 90-minute CPU candidate.
  [grouped5-2000]="--set train.questions_per_window=5 --set train.num_steps=2000"
  [grouped5]="--set train.questions_per_window=5"
  # The best CPU recipe distilled: its teacher trains 2,000 steps of 12 (question, window) pairs,
  # then writes logits for the ~90k examples of the run (~2 h of teacher forwards on a 2-core CPU).
  [grouped5-2000-distill]="--set train.questions_per_window=5 --set train.num_steps=2000"
  # For the accelerator recipe (CONFIG=experiments/squad.py: batch 48 windows, ~550 steps of
  # ~215 questions an epoch): 4 epochs, ~2,200 steps, ~0.6x the phrase-encoder work of the
  # default's 3,664 steps of 48 windows and ~2.3x its question passes.
  [grouped5-e4]="--set train.questions_per_window=5 --set train.epochs=4"
  # The accelerator recipe without dropout (the CPU configs have none): at the CPU budget
  # dropout 0.1 cost 5.06 RC EM (37.57 vs 42.63, McNemar p = 7e-38; results/recipe.md), and
  # without it cuDNN's fused attention (DPJAX_ATTENTION=cudnn) can run in training.
  [nodrop]="--set train.dropout=False"
  # The config's recipe in bfloat16 (float32 parameters, softmax, LayerNorm and loss): at the
  # CPU budget it matched float32 (RC EM 42.62 vs 42.63, p = 1), so experiments/squad.py's
  # accelerator recipe computes in bf16; `fp32` is that recipe in float32, its full-scale check.
  [bf16]="--set model.dtype=bfloat16"
  [fp32]="--set model.dtype=float32"
  # bfloat16 compute (float32 sums; a CPU train step 1.32x float32's): the same 2,000 steps
  # (quality, paired with grouped5-2000), then the steps that fit the same ~72 minutes.
  [grouped5-2000-bf16]="--set train.questions_per_window=5 --set train.num_steps=2000"
  [grouped5-2600-bf16]="--set train.questions_per_window=5 --set train.num_steps=2600"
)
RUNS[grouped5-2000-distill]+=" --set train.teacher_logits=teacher/logits"
RUNS[grouped5-2000-bf16]+=" --set model.dtype=bfloat16"
RUNS[grouped5-2600-bf16]+=" --set model.dtype=bfloat16"
if [ "${1:-}" = --settings ]; then
  [ -n "${RUNS[${2:-}]+x}" ] || { echo "unknown run ${2:-}"; exit 2; }
  echo "${RUNS[$2]}"; exit 0
fi
ORDER=(base lr2e-4 grouped3 scale2 scale0.5 inb4 lr5e-5 prb4 prb0 warm0.2 warm0.02 dropout
       len128 len256 distill grouped3-distill grouped5-2000 grouped5 grouped5-e4
       grouped5-2000-distill grouped5-2000-bf16 grouped5-2600-bf16 bf16 nodrop fp32)
for name in "${@:-${ORDER[@]}}"; do
  [ -n "${RUNS[$name]+x}" ] || { echo "unknown run $name (one of ${ORDER[*]})"; exit 2; }
  W=$OUT/$name
  if [ -f "$W/results.json" ]; then echo "=== $name: done ($W/results.json)"; continue; fi
  if [[ "$name" == *distill ]]; then  # the teacher and its logits first, into the same workdir,
    # for the examples of this run's steps (its settings without the logits)
    echo "=== $(date -Is) teacher for $name ($(git rev-parse --short HEAD))"
    $PY run.py teacher --config "$CONFIG" --workdir "$W" --set train.progress_bar=False \
        ${RUNS[$name]/--set train.teacher_logits=teacher\/logits/} $SET || exit $?
  fi
  echo "=== $(date -Is) start $name ($(git rev-parse --short HEAD)): ${RUNS[$name]}"
  began=$(date +%s)
  $PY run.py train --config "$CONFIG" --workdir "$W" --set train.progress_bar=False \
      ${RUNS[$name]} $SET || exit $?
  echo "=== $name wall $(( $(date +%s) - began )) s"
done
