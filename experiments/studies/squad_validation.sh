#!/bin/bash
# The validation experiment of results/validation.md (Kim et al. 2022, Figure 2, at our scale):
#  1. hard negatives of every SQuAD training question, mined with the 900-step unified model and
#     its IVF-SQ4 index (nprobe 64: mining needs hard passages, not exact ones);
#  2. a third model trained like the 900-step unified one (same budget overrides, same seed) plus
#     h = 1 mined passage per example (keeps all 5 checkpoints: intermediate models);
#  3. the subcorpora C0, R_r, H_k of a random 2,000 dev questions, H_k from the unified model's
#     exact index;
#  4. every model's full dump (made once, resumable), its accuracy on each subcorpus and on the full
#     corpus, and Kendall tau -> results/validation.{json,md}; the notebook draws the figure.
# Every step resumes or is skipped when its output exists, so the script can be rerun after a kill.
# Usage: nohup bash experiments/studies/squad_validation.sh > logs/squad_validation.log 2>&1 &
# (extra arguments go to validation_experiment.py, e.g. --note "...")
# (after 900-step runs of both recipes and the unified one's dump and index; results/squad_rc.md
#  and results/squad_open.md give their commands)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
U=${U:-workdirs/squad-cpu-unified}
O=${O:-workdirs/squad-cpu-original}
H=${H:-workdirs/squad-cpu-unified-hn}
# `:cpu-base` is what `:cpu` meant when results/validation.md ran (one question per window, which
# hard negatives need; float32 dumps).
CPU="--config experiments/squad.py:cpu-base"
OLD="--set train.num_steps=900 --set train.dropout=True --set train.checkpoint_every=200 --set train.log_every=20 --set train.loss.lambda_inb=256"

[ -f $U/hard_negatives.jsonl ] || $PY run.py mine $CPU --workdir $U \
    --set index.search_index=IVFauto_SQ4 --set index.nprobe=64
[ -f $H/results.json ] || $PY run.py train $CPU --workdir $H --set train.loss.recipe=unified --set train.progress_bar=False \
    $OLD --set train.keep_checkpoints=5 --set train.hard_negatives.file=$U/hard_negatives.jsonl
[ -f $U/subcorpora/H32.meta.json ] || $PY run.py subcorpus $CPU --workdir $U \
    --set validation.sample_questions=2000
$PY experiments/studies/validation_experiment.py $CPU --subcorpora $U/subcorpora \
    --model original-800=$O@800 --model original-900=$O@900 \
    --model unified-800=$U@800 --model unified-900=$U@900 \
    --model unified+hn-400=$H@400 --model unified+hn-900=$H@900 \
    --compare unified-900:original-900 --compare unified-800:original-800 \
    --compare unified+hn-900:unified-900 \
    --compare unified+hn-900:original-900 --out results/validation.json "$@"
