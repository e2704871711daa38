"""Chooses `index.reread_margin` on training questions: the hybrid search re-reading up to R
passages (`index.reread=R`) with each margin of a grid, against re-reading all R.

  taskset -c 1 python experiments/benchmarks/reread_margin.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --set index.sparse=True --set index.reread=3 ... \\
      --out results/reread_margin.json

The questions are those hybrid weights are chosen on (`hybrid_weights.tune_questions`: the
index.sparse_tune_questions training questions of its seed), so the dev questions stay unseen.
Per margin, from an empty cache, in batches of 64: EM@1, passage Top-1 (the answer in the top
phrase's passage) and the passages encoded per question (`Rereader.encoded_passages`). The
choice: the smallest margin whose EM@1 and Top-1 are both within `--tolerance` points of
re-reading all R passages.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.report import command_line, git_commit  # noqa: E402

MARGINS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def measure(searcher, questions, margin, max_answer_length: int, **reader) -> dict:
  """EM@1, top-1 passage hit, passages and tokens encoded per question of one margin (and the
  re-reader's other attributes `reader`, e.g. window), from an empty cache."""
  import numpy as np

  from dpjax import metrics
  rereader = searcher.index.reread
  rereader.margin = margin
  for name, value in reader.items():
    setattr(rereader, name, value)
  rereader.clear()
  passages, tokens = rereader.encoded_passages, rereader.encoded_tokens
  begin = time.perf_counter()
  found = []
  for lo in range(0, len(questions), 64):
    found += searcher.search([q.question for q in questions[lo:lo + 64]], k=10,
                             max_answer_length=max_answer_length)
  em = [bool(f) and max(metrics.exact_match(f[0]["answer"], a) for a in q.answers) > 0
        for f, q in zip(found, questions)]
  hit = [bool(f) and metrics.has_answer(f[0]["passage"], list(q.answers))
         for f, q in zip(found, questions)]
  return {"margin": margin, **reader, "em@1": 100 * float(np.mean(em)),
          "top1": 100 * float(np.mean(hit)),
          "passages_per_question": (rereader.encoded_passages - passages) / len(questions),
          "tokens_per_question": (rereader.encoded_tokens - tokens) / len(questions),
          "seconds": time.perf_counter() - begin}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--margin", action="append", type=float, default=[])
  parser.add_argument("--tolerance", type=float, default=0.5)
  parser.add_argument("--out", default="results/reread_margin.json")
  args = parser.parse_args(argv)
  from dpjax.config import load_settings, setup_logging
  from dpjax.distributed import enable_compilation_cache
  from dpjax.index.hybrid_weights import tune_questions
  from dpjax.io import write_json
  from dpjax.main import open_searcher
  from dpjax.workdir import Workdir
  setup_logging()
  enable_compilation_cache()
  settings = load_settings(args.config, args.set)
  if not settings.index.reread or settings.index.reread_margin is not None:
    raise SystemExit("set index.reread (> 0) and no index.reread_margin: the margins are this "
                     "study's")
  workdir = Workdir(args.workdir)
  searcher = open_searcher(settings, workdir)[0]
  questions, path = tune_questions(settings.data, settings.index, workdir)
  length = settings.eval.max_answer_length
  rows = [measure(searcher, questions, None, length)]
  rows += [measure(searcher, questions, m, length) for m in sorted(args.margin or MARGINS)]
  full = rows[0]
  close = [r for r in rows[1:] if full["em@1"] - r["em@1"] <= args.tolerance
           and full["top1"] - r["top1"] <= args.tolerance]
  out = {"commit": git_commit(), "command": command_line("experiments/benchmarks/reread_margin.py",
                                                         sys.argv[1:] if argv is None else argv),
         "questions": len(questions), "questions_file": path, "reread": settings.index.reread,
         "tolerance": args.tolerance, "rows": rows,
         "chosen": close[0]["margin"] if close else None}
  write_json(pathlib.Path(args.out), out)
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
