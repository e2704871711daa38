"""Hard negatives mined by a model (Kim et al. 2022, Section 5.2), and their use in training.

`mine_hard_negatives`: for every training question, the top-k phrases a model retrieves from a
full index; the passages of those phrases, in rank order, minus every passage that contains a
gold answer (normalised token-sequence match, `metrics.has_answer`) and minus passages that are
not training passages (dev passages must not be trained on), are the question's hard negatives.
`run.py mine` writes them as JSONL, one line per question:
  {"id": question id, "passages": [training passage index, ...], "start_chars": [...]}
(`start_chars`: where the retrieved phrase starts in each passage).

Training reads and samples them (`dpjax.data.hard_negatives`).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Sequence

import numpy as np

from dpjax import metrics
from dpjax.data.squad import Question
from dpjax.errors import DataError
from dpjax.io import write_lines_atomic

log = logging.getLogger(__name__)


def filter_negatives(retrieved: Sequence[tuple[int, int]], answers: Sequence[str],
                     passage_texts: Sequence[str], gold_passage: int) -> tuple[list, list]:
  """Ranked unique passages of `retrieved` [(passage, start_char)] without any gold answer.

  Returns:
    (passages, start_chars), the first retrieved phrase's start for each passage.
  """
  passages, starts, seen = [], [], {gold_passage}
  for passage, start_char in retrieved:
    if passage in seen:
      continue
    seen.add(passage)
    if metrics.has_answer(passage_texts[passage], answers):
      continue
    passages.append(int(passage))
    starts.append(int(start_char))
  return passages, starts


def mine_hard_negatives(searcher, questions: Sequence[Question], train_passages: Sequence,
                        out_path: str | os.PathLike, *, top_k: int = 100,
                        max_answer_length: int = 10, batch_size: int = 1024) -> dict:
  """Writes the hard negatives of every training question to `out_path` (JSONL); returns counts.

  Args:
    searcher: a `PhraseSearcher` over the full index (its dump's passages include the training
      passages; others are dropped).
    questions, train_passages: the training split (`read_squad`).
  """
  dump_passages = searcher.index.dump.passages
  key_to_train = {(p.title, p.text): i for i, p in enumerate(train_passages)}
  dump_to_train = np.array([key_to_train.get((p.title, p.text), -1) for p in dump_passages])
  if (dump_to_train >= 0).sum() == 0:
    raise DataError("no passage of the index is a training passage: mine with an index of a "
                    "corpus that contains the training passages")
  texts = [p.text for p in train_passages]
  out_path = pathlib.Path(out_path)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  counts = {"questions": 0, "with_negatives": 0, "negatives": 0, "dropped_with_answer": 0}

  def lines():
    for lo in range(0, len(questions), batch_size):
      chunk = questions[lo:lo + batch_size]
      found = searcher.search([q.question for q in chunk], k=top_k, unit="phrase",
                              max_answer_length=max_answer_length)
      for q, results in zip(chunk, found):
        retrieved = [(dump_to_train[r["passage_row"]], r["start_char"]) for r in results
                     if dump_to_train[r["passage_row"]] >= 0]
        candidates = len({p for p, _ in retrieved} - {q.passage_index})
        passages, starts = filter_negatives(retrieved, q.answers, texts, q.passage_index)
        counts["questions"] += 1
        counts["with_negatives"] += bool(passages)
        counts["negatives"] += len(passages)
        counts["dropped_with_answer"] += candidates - len(passages)
        yield json.dumps({"id": q.id, "passages": passages, "start_chars": starts}) + "\n"
      log.info("mined %d of %d questions", min(lo + batch_size, len(questions)), len(questions))

  write_lines_atomic(out_path, lines())
  return counts
