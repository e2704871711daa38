"""`run.py mine`: hard negatives for the training questions, mined with the model and its index.
"""
from __future__ import annotations

from dpjax.data import data_files
from dpjax.data.squad import read_squad
from dpjax.workdir import Workdir
from dpjax.mining import mine_hard_negatives
from dpjax.main import open_searcher, writes_to
from dpjax.settings import Settings


@writes_to
def run(settings: Settings, workdir: Workdir) -> dict:
  """Mines hard negatives for the training questions with the model and its full index."""
  files = data_files(settings.data, workdir)
  passages, questions, _ = read_squad(files["train"])
  if settings.mine.limit:
    questions = questions[:settings.mine.limit]
  searcher, _ = open_searcher(settings, workdir)
  out = workdir / settings.mine.out
  counts = mine_hard_negatives(searcher, questions, passages, out, top_k=settings.mine.top_k,
                               max_answer_length=settings.eval.max_answer_length)
  print(f"hard negatives of {counts['questions']} questions -> {out}: "
        f"{counts['negatives'] / max(counts['questions'], 1):.1f} per question, "
        f"{counts['with_negatives']} questions with at least one, "
        f"{counts['dropped_with_answer']} retrieved passages dropped (they contain an answer)")
  return counts
