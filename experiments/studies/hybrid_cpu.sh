#!/usr/bin/env bash
# Issue 59's measurements on a CPU: the `:cpu` phrase model and the `:cpu-base` reader, then every
# row of results/hybrid.md (dense, merged or not, hybrid, BM25 on all 10,570 SQuAD dev questions;
# the readers on 1,000 of them) over SQuAD-open small. Each step resumes or is skipped when its
# output exists, so a killed run continues where it stopped; pin it to a core: `taskset -c 1 ...`.
# Usage: nohup taskset -c 1 bash experiments/studies/hybrid_cpu.sh [PHRASE_WORKDIR] [READER_WORKDIR] \
#            > logs/hybrid_cpu.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
W=${1:-workdirs/squad-cpu}
R=${2:-workdirs/reader}
C="--config experiments/squad.py:cpu --workdir $W"
PEER="experiments/benchmarks/reader_peer.py $C --reader $R --reader-config experiments/squad.py:cpu-base"
# Reading is the slow step on a CPU (results/reader_peer.md): the reader rows read 1,000 random
# dev questions (seeded), and hybrid.py shows the other rows on them too.
PEER="$PEER --k 10 --sample 1000 --out results/reader_peer.json"
has() { grep -q "\"$1\"" results/reader_peer.json 2>/dev/null; }  # rows measured already
# The reader: trained for :cpu-base's 1,500 steps (then `teacher` also writes its distillation
# logits, which these rows do not read: skipped once the last checkpoint is there).
[ -d "$R/teacher/checkpoints/1500" ] || $PY run.py teacher --config experiments/squad.py:cpu-base \
    --workdir "$R" --set train.progress_bar=False
# BM25's reader rows need no phrase model (on a second core they can run beside the next steps).
has "bm25+reader" || $PY $PEER --systems bm25
$PY run.py train $C --set train.progress_bar=False
$PY run.py dump $C
[ -f "$W/dump/indexes/Flat/index_manifest.json" ] || $PY run.py index $C --set 'index.specs=["Flat"]' \
    --set index.sparse=False
has "dpjax+reader" || $PY $PEER --systems dpjax --set index.sparse=False
# The hybrid search's passages read: its BM25 index and weights first (hybrid.py reuses them);
# hybrid reader rows of other weights are measured again (they replace the old ones).
$PY run.py index $C --set index.sparse=True --set 'index.specs=[]'
fresh_hybrid() {  # hybrid reader rows there, searched with the weights the BM25 index records now
  $PY - "$W" <<'PY'
import json, pathlib, sys
bm25 = json.loads((pathlib.Path(sys.argv[1]) / "dump/indexes/bm25/sparse_manifest.json").read_text())
row = json.loads(pathlib.Path("results/reader_peer.json").read_text())["systems"]["hybrid+reader"]
weights = [(r.get("weight"), r.get("sentence_weight")) for r in (row["hybrid"], bm25)]
sys.exit(weights[0] != weights[1])
PY
}
fresh_hybrid 2>/dev/null || $PY $PEER --systems dpjax --set index.sparse=True
$PY experiments/benchmarks/hybrid.py $C --reader-json results/reader_peer.json --out results/hybrid.json
