"""Hard negatives mined by a model (Kim et al. 2022, Section 5.2), and their use in training.

`mine_hard_negatives`: for every training question, the top-k phrases a model retrieves from a
full index; the passages of those phrases, in rank order, minus every passage that contains a
gold answer (normalised token-sequence match, `metrics.has_answer`) and minus passages that are
not training passages (dev passages must not be trained on), are the question's hard negatives.
`run.py mine` writes them as JSONL, one line per question:
  {"id": question id, "passages": [training passage index, ...], "start_chars": [...]}
(`start_chars`: where the retrieved phrase starts in each passage).

`HardNegatives` samples `per_example` of them for each example of a batch (random other
training passages without a gold answer when a question has fewer) and returns the windows to
add as N_hard.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Sequence

import numpy as np

from dpjax import metrics
from dpjax.data import data_files
from dpjax.data.squad import JSON_ERRORS, DataError, PassageWindows, Question, read_squad
from dpjax.io import write_lines_atomic
from dpjax.workdir import load_searcher, writes_to

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
    searcher: a `DensePhrases` over the full index (its dump's passages include the training
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


def read_hard_negatives(path: str | os.PathLike, questions: Sequence[Question],
                        num_passages: int) -> list[list]:
  """Per training question (by position), its [(passage, start_char)] hard negatives (passage:
  a row of the `num_passages` training passages; a record out of range is a DataError)."""
  index = {q.id: i for i, q in enumerate(questions)}
  mined: list[list] = [[] for _ in questions]
  path = pathlib.Path(path)
  if not path.is_file():
    raise DataError(f"{path}: hard-negative file not found (run `run.py mine`)")
  unknown = 0
  with path.open() as f:
    for number, line in enumerate(f, 1):
      try:
        row = json.loads(line)
        pairs = list(zip(row["passages"], row["start_chars"]))
      except (*JSON_ERRORS, KeyError, TypeError) as e:
        raise DataError(f"{path}:{number}: not a hard-negative record ({e})") from None
      bad = [p for p, c in pairs if not (_row(p) and 0 <= p < num_passages and _row(c))]
      if bad:
        raise DataError(f"{path}:{number}: passage {bad[0]!r} is not a row of the "
                        f"{num_passages} training passages (mined from other training data? "
                        "run `run.py mine` again)")
      if row["id"] in index:
        mined[index[row["id"]]] = pairs
      else:
        unknown += 1
  if unknown:
    log.warning("%s: %d records for questions not in the training set (ignored)", path, unknown)
  return mined


def _row(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class HardNegatives:
  """Samples hard-negative windows for the examples of a batch."""

  RANDOM_DRAWS = 64  # draws for a random negative without the answer before taking any other

  def __init__(self, mined: list[list], windows: PassageWindows, questions: Sequence[Question],
               passage_texts: Sequence[str], per_example: int, seed: int):
    self.mined, self.windows, self.per_example, self.seed = mined, windows, per_example, seed
    self.questions, self.texts = questions, passage_texts
    order = np.argsort(windows.passage_index, kind="stable")
    bounds = np.searchsorted(windows.passage_index[order],
                             np.arange(windows.passage_index.max() + 2))
    self.passage_windows = [order[bounds[p]:bounds[p + 1]] for p in range(len(bounds) - 1)]
    self.num_passages = len(self.passage_windows)
    if self.num_passages < 2:
      raise DataError("hard negatives need at least 2 training passages")
    self.random_with_answer = 0  # random negatives that contain the answer (none other found)

  def _window(self, passage: int, start_char: int) -> int:
    """The window of `passage` holding `start_char` as a max-context token (else the first)."""
    w = self.windows
    for window in self.passage_windows[passage]:
      hit = (w.char_start[window] <= start_char) & (start_char < w.char_end[window]) & \
          w.context_mask[window] & w.is_max_context[window]
      if hit.any():
        return int(window)
    return int(self.passage_windows[passage][0])

  def _random_window(self, rng: np.random.Generator, q: int) -> int:
    """A window of a random other training passage that holds no gold answer of question `q`
    (`metrics.has_answer`, as mining drops them); after `RANDOM_DRAWS` draws without one, of
    any other passage (counted in `random_with_answer`, warned once)."""
    question = self.questions[q]
    for _ in range(self.RANDOM_DRAWS):
      passage = int(rng.integers(self.num_passages))
      if (passage != question.passage_index and len(self.passage_windows[passage])
          and not metrics.has_answer(self.texts[passage], question.answers)):
        return int(rng.choice(self.passage_windows[passage]))
    others = [p for p in range(self.num_passages)
              if p != question.passage_index and len(self.passage_windows[p])]
    if not others:
      raise DataError(f"question {question.id}: no other training passage to draw a negative "
                      "from")
    if not self.random_with_answer:
      log.warning("question %s: no random negative without its answer found in %d draws; "
                  "taking one with it (counted in random_with_answer)", question.id,
                  self.RANDOM_DRAWS)
    self.random_with_answer += 1
    return int(rng.choice(self.passage_windows[others[int(rng.integers(len(others)))]]))

  def __call__(self, step: int, questions: np.ndarray) -> dict[str, np.ndarray]:
    """Hard-negative windows for the examples of questions `questions` ([B] indices)."""
    chosen = []
    for q in questions.tolist():
      rng = np.random.default_rng([self.seed, step, q])  # per example: any split of the batch
      pool = self.mined[q]
      picks = rng.permutation(len(pool))[:self.per_example]
      row = [self._window(*pool[i]) for i in picks]
      row += [self._random_window(rng, q) for _ in range(self.per_example - len(row))]
      chosen.append(row)
    windows = np.asarray(chosen, np.int64).reshape(-1)  # [B * h], example-major
    w = self.windows
    return {"hard_input_ids": w.input_ids[windows],
            "hard_attention_mask": w.attention_mask[windows],
            "hard_context_mask": w.context_mask[windows],
            "hard_passage_ids": w.passage_index[windows].astype(np.int32)}


@writes_to
def run_mine(config, workdir: str) -> dict:
  """Mines hard negatives for the training questions with the model and its full index."""
  workdir = pathlib.Path(workdir)
  files = data_files(config.data, workdir)
  passages, questions, _ = read_squad(files["train"])
  if config.mine.limit:
    questions = questions[:config.mine.limit]
  searcher, _ = load_searcher(config, workdir)
  out = workdir / config.mine.out
  counts = mine_hard_negatives(searcher, questions, passages, out, top_k=config.mine.top_k,
                               max_answer_length=config.eval.max_answer_length)
  print(f"hard negatives of {counts['questions']} questions -> {out}: "
        f"{counts['negatives'] / max(counts['questions'], 1):.1f} per question, "
        f"{counts['with_negatives']} questions with at least one, "
        f"{counts['dropped_with_answer']} retrieved passages dropped (they contain an answer)")
  return counts

