#!/bin/bash
# SQuAD-open small (results/squad_open.md): every token of the 20,958 unique SQuAD train + dev
# paragraphs, indexed with Flat, IVF-SQ4 and OPQ-IVF-PQ; the 10,570 dev questions open-domain.
# Usage: bash experiments/squad_open.sh [WORKDIR]   (a workdir trained with squad.py:cpu)
set -euo pipefail
W=${1:-workdirs/squad-cpu-unified}
C="--config experiments/squad.py:cpu --workdir $W"
PY=${PY:-.venv/bin/python}
$PY run.py dump $C
$PY run.py index $C
for index in Flat IVFauto_SQ4 OPQ96_IVFauto_PQ96x8; do  # Flat first: the others report agreement
  $PY run.py eval $C --set index.search_index=$index
done
