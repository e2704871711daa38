#!/bin/bash
# Query-side fine-tuning on SQuAD-open small (results/qsft.md): the workdir's model on its exact
# index, then on the IVF-SQ4 index without and with quantisation-aware training (candidates as the
# quantizer reconstructs them). Each run writes <workdir>/qsft_results_<index>[_quantized].json;
# the fine-tuned encoders of the last run are in <workdir>/checkpoints_qsft.
# Usage: bash experiments/studies/squad_qsft.sh [WORKDIR]   (after `run.py dump` and `run.py index`
#   of WORKDIR with squad.py:cpu, as in results/squad_open.md)
set -euo pipefail
W=${1:-workdirs/squad-cpu-unified}
C="--config experiments/squad.py:cpu --workdir $W"
PY=${PY:-.venv/bin/python}
$PY run.py qsft $C --set qsft.index=Flat
$PY run.py qsft $C --set qsft.index=IVFauto_SQ4
$PY run.py qsft $C --set qsft.index=IVFauto_SQ4 --set qsft.quantized=True
