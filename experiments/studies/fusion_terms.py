"""Which terms hybrid search fuses, compared on held-out training questions only.

  python experiments/studies/fusion_terms.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --questions 4000 --seed 101 --out results/fusion_terms.json

For N seeded training questions it collects once every candidate passage (the dense search's top
20 passages and BM25's top 50) with every best span of its tokens (`hybrid.lexical_spans`, as
hybrid search scores a BM25 passage), then ranks the passages offline by the fused score of their
best span (a passage's own terms are the same for all its spans) under each variant:
  passage   a passage's dense evidence: its best span (what hybrid search uses), log-sum-exp of
            its spans' scores at temperature T, the best plus half the second best;
  bm25      passage BM25 with other Lucene k1 / b than the index's 0.9 / 0.4;
  sentence  + a sentence weight x the BM25 of the sentence a span starts in (as hybrid search
            scores it from the passage index's statistics), over each passage's top 10 spans.
Each variant's weights are the best of a grid by the mean of phrase EM@1 (the top passage's best
span) and passage Top-1, the way `dpjax.index.hybrid_weights.choose_weight` picks them; every grid
point is in the JSON. Needs the workdir's dump, Flat index and BM25 index (`run.py index --set
index.sparse=True`).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

WEIGHTS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # passage BM25 weights tried for every variant
SENTENCE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
SPANS = 10  # a passage's top spans the sentence term can pick among
AGGREGATES = {
    "best span": lambda s: s[0],
    "log-sum-exp, T 1": lambda s: float(np.logaddexp.reduce(s.astype(np.float64))),
    "log-sum-exp, T 2": lambda s: 2 * float(np.logaddexp.reduce(s.astype(np.float64) / 2)),
    "best + 0.5 x second": lambda s: s[0] + 0.5 * (s[1] if len(s) > 1 else s[0]),
}
K1_B = ((0.9, 0.4), (0.6, 0.3), (0.9, 0.6), (1.2, 0.4), (1.2, 0.75), (1.5, 0.5), (0.9, 0.2))


def collect(searcher, sparse, questions, max_answer_length: int) -> list[dict]:
  """Per question: its candidate passages, each with its spans' dense scores (best first), its
  top spans' EM, their sentences' BM25 and whether its text holds an answer."""
  from dpjax import metrics
  from dpjax.index import hybrid
  index, dump = searcher.index, searcher.index.dump
  texts = [q.question for q in questions]
  q_start, q_end = searcher.encode(texts)
  dense = index.search(q_start, q_end, 20, "passage", max_answer_length=max_answer_length)
  lexical = hybrid.top_passages(sparse.scores(texts), 50)
  candidates = [np.unique(np.concatenate([[p.passage for p, _ in found], top]).astype(np.int64))
                for found, top in zip(dense, lexical)]
  spans = hybrid.lexical_spans(index.rescorer, q_start, q_end, candidates, max_answer_length)
  out = []
  for question, terms, rows, (starts, ends, scores) in zip(
      questions, sparse.question_terms(texts), candidates, spans):
    of = dump.token_passage[starts]
    keep = [row for row in rows if (of == row).any()]
    passages = []
    for row in keep:
      mine = np.flatnonzero(of == row)
      mine = mine[np.argsort(-scores[mine], kind="stable")]
      top = [index.phrase(int(starts[i]), int(ends[i]), float(scores[i])) for i in mine[:SPANS]]
      passages.append({
          "scores": scores[mine].astype(np.float32),
          "em": [metrics.max_over_gold(metrics.exact_match, p.text, question.answers) > 0
                 for p in top],
          "sentences": sparse.sentence_scores(terms, np.full(len(top), row),
                                              [p.start_char for p in top], dump.passages),
          "has": metrics.has_answer(dump.passages[row].text, question.answers)})
    out.append({"rows": np.array(keep, np.int64), "passages": passages})
  return out


def passage_bm25(texts: list[str], found: list[dict], passages, k1: float, b: float) -> list:
  """Each question's BM25 of its candidate passages under Lucene's k1 and b."""
  from dpjax.index import sparse
  retriever = sparse.bm25_of([sparse.passage_text(p) for p in passages], k1=k1, b=b)
  return [retriever.get_scores(terms)[q["rows"]] if terms else np.zeros(len(q["rows"]))
          for terms, q in zip(sparse.tokenize(texts), found)]


def rank(found: list[dict], bm25: list, weight: float, aggregate=AGGREGATES["best span"],
         sentence: list | None = None, sentence_weight: float = 0.0) -> dict:
  """Phrase EM@1 and passage Top-1 (x100) of the passages ranked by their best fused span."""
  em = top1 = 0
  for q, (question, lexical) in enumerate(zip(found, bm25)):
    best, pick = -np.inf, None
    for i, passage in enumerate(question["passages"]):
      if sentence_weight:
        fused = (passage["scores"][:SPANS] + sentence_weight * sentence[q][i]) + weight * lexical[i]
        j = int(np.argmax(fused))
        value = fused[j]
      else:
        j, value = 0, aggregate(passage["scores"]) + weight * lexical[i]
      if value > best:
        best, pick = value, (passage, j)
    if pick:
      top1, em = top1 + pick[0]["has"], em + pick[0]["em"][pick[1]]
  n = max(len(found), 1)
  return {"em@1": 100 * em / n, "top1": 100 * top1 / n}


def best_of(grid: dict) -> tuple[str, dict]:
  """The grid point with the best mean of EM@1 and Top-1 (ties: the first, the smaller weights)."""
  return max(grid.items(), key=lambda item: item[1]["em@1"] + item[1]["top1"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--questions", type=int, default=4000)
  parser.add_argument("--seed", type=int, default=101)
  parser.add_argument("--train-file", help="training questions (default: the config's)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  from dpjax.config import load_config, setup_logging
  from dpjax.data import data_files
  from dpjax.data.questions import read_questions, sample_questions
  from dpjax.index.sparse import SETTINGS, SparseIndex
  from dpjax.main import open_searcher
  from dpjax.settings import Settings
  from experiments.report import git_commit, save_results
  setup_logging()
  settings = Settings.of(load_config(args.config, []))
  # the dense search: the terms are added here
  settings = dataclasses.replace(settings,
                                 index=dataclasses.replace(settings.index, sparse=False))
  searcher, step = open_searcher(settings, pathlib.Path(args.workdir))
  dump = searcher.index.dump
  sparse = SparseIndex(dump.directory, dump.manifest)
  path = args.train_file or str(data_files(settings.data, pathlib.Path(args.workdir))["train"])
  questions = sample_questions(read_questions(path), args.questions, args.seed)
  start = time.perf_counter()
  found = collect(searcher, sparse, questions, settings.eval.max_answer_length)
  texts = [q.question for q in questions]
  sentence = [[p["sentences"] for p in q["passages"]] for q in found]
  grids = {}
  index_bm25 = passage_bm25(texts, found, dump.passages, SETTINGS["k1"], SETTINGS["b"])
  for name, aggregate in AGGREGATES.items():
    grids[f"passage: {name}"] = {f"{w:g}": rank(found, index_bm25, w, aggregate) for w in WEIGHTS}
  for k1, b in K1_B[1:]:
    bm25 = passage_bm25(texts, found, dump.passages, k1, b)
    grids[f"bm25: k1 {k1:g}, b {b:g}"] = {f"{w:g}": rank(found, bm25, w) for w in WEIGHTS}
  grids["sentence"] = {f"{w:g},{ws:g}": rank(found, index_bm25, w, sentence=sentence,
                                               sentence_weight=ws)
                       for w in WEIGHTS for ws in SENTENCE_WEIGHTS}
  results = {"config": args.config, "workdir": args.workdir, "model_step": step,
             "commit": git_commit(), "questions": len(questions), "file": path,
             "seed": args.seed, "seconds": time.perf_counter() - start,
             "bm25": {"k1": SETTINGS["k1"], "b": SETTINGS["b"]},
             "rows": {name: {"weights": best_of(grid)[0], **best_of(grid)[1], "grid": grid}
                      for name, grid in grids.items()}}
  save_results(args.out, results, table, "experiments/studies/fusion_terms.py", argv)
  return 0


def table(results: dict, command: str) -> str:
  lines = ["# Hybrid search: which terms to fuse (held-out training questions)", "",
           f"Command: `{command}` (commit {results['commit']}); {results['questions']} training "
           f"questions of {results['file']} (seed {results['seed']}), model step "
           f"{results['model_step']}. Passages ranked by their best fused span; each row's "
           "weights (passage BM25, and sentence BM25 for the sentence row) are the best of its "
           "grid by the mean of EM@1 and passage Top-1.", "",
           "| variant | weights | EM@1 | passage Top-1 | mean |", "|---|---|---|---|---|"]
  for name, row in results["rows"].items():
    lines.append(f"| {name} | {row['weights']} | {row['em@1']:.2f} | {row['top1']:.2f} | "
                 f"{(row['em@1'] + row['top1']) / 2:.2f} |")
  lines += ["", f"The passage rows use the index's BM25 (k1 {results['bm25']['k1']:g}, b "
            f"{results['bm25']['b']:g}) and best span is what hybrid search without the sentence "
            "term does; every grid point is in the JSON."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
