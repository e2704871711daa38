"""How hybrid search's BM25 half is scaled, compared on held-out training questions only.

  python experiments/studies/fusion_scale.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --out results/fusion_scale.json

For each scaling of a question's BM25 scores, the weight is chosen as `run.py index` chooses it
(`dpjax.index.hybrid_weights.choose_weight`: the best mean of phrase EM@1 and passage Top-1 on
`index.sparse_tune_questions` seeded training questions, never the dev questions) over a grid
fitting that scale; the table gives each scaling's best weight and its scores there:
  raw  the BM25 score as it is (what hybrid search adds), on a finer grid than `fusion.WEIGHTS`;
the sentence weight is held at 0 (passage BM25 alone, as before the sentence term).
  max  divided by the question's highest BM25 score over the corpus (its best passage scores 1).
Needs the workdir's dump, Flat index and BM25 index (`run.py index --set index.sparse=True`).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

SCALINGS = {
    "raw": (lambda s: s, (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0)),
    "max": (lambda s: s / np.maximum(s.max(axis=1, keepdims=True), 1e-9),
            (0.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  from dpjax.index import hybrid_weights as fusion
  from dpjax.config import load_config, setup_logging
  from dpjax.index.sparse import SparseIndex
  from dpjax.main import open_searcher
  from dpjax.settings import Settings
  from experiments.report import git_commit
  from experiments.report import save_results
  setup_logging("dpjax.index.hybrid_weights", fmt="%(asctime)s %(message)s")
  settings = Settings.of(load_config(args.config, args.set))
  workdir = pathlib.Path(args.workdir)
  # the weights are set one by one
  dense = dataclasses.replace(settings, index=dataclasses.replace(settings.index, sparse=False))
  searcher, step = open_searcher(dense, workdir)
  dump = searcher.index.dump
  raw_scores = SparseIndex.scores
  weights = fusion.WEIGHTS, fusion.SENTENCE_WEIGHTS
  rows = {}
  try:
    for name, (scale, grid) in SCALINGS.items():
      SparseIndex.scores = lambda self, texts, scale=scale: scale(raw_scores(self, texts))
      fusion.WEIGHTS, fusion.SENTENCE_WEIGHTS = grid, (0.0,)  # passage BM25 alone
      # a new SparseIndex: the searcher caches BM25 results by index object
      weight, _, tuning = fusion.choose_weight(settings.data, settings.eval, settings.index,
                                               workdir, searcher, step,
                                               SparseIndex(dump.directory, dump.manifest))
      rows[name] = {"weight": weight, **tuning["scores"][fusion.pair_key(weight, 0.0)],
                    "scores": tuning["scores"], "questions": tuning["questions"],
                    "file": str(tuning["file"]), "seed": tuning["seed"]}
  finally:
    SparseIndex.scores = raw_scores
    fusion.WEIGHTS, fusion.SENTENCE_WEIGHTS = weights
  results = {"config": args.config, "workdir": args.workdir, "model_step": step,
             "commit": git_commit(), "rows": rows}
  save_results(args.out, results, table, "experiments/studies/fusion_scale.py", argv)
  return 0


def table(results: dict, command: str) -> str:
  first = next(iter(results["rows"].values()))
  lines = ["# Hybrid search: how BM25 is scaled (held-out training questions)", "",
           f"Command: `{command}` (commit {results['commit']}); {first['questions']} training "
           f"questions of {first['file']} (seed {first['seed']}), model step "
           f"{results['model_step']}. Each scaling's weight chosen by "
           "`dpjax.index.hybrid_weights.choose_weight` (mean of EM@1 and passage Top-1).", "",
           "| scaling | weight | EM@1 | EM@10 | passage Top-1 | Top-20 | mean of EM@1 and Top-1 |",
           "|---|---|---|---|---|---|---|"]
  for name, row in results["rows"].items():
    lines.append(f"| {name} | {row['weight']:g} | {row['em@1']:.2f} | {row['em@10']:.2f} | "
                 f"{row['top1']:.2f} | {row['top20']:.2f} | "
                 f"{(row['em@1'] + row['top1']) / 2:.2f} |")
  lines += ["", "Every weight's scores are in the JSON."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
