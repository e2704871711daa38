"""Mined hard negatives (`run.py mine`'s JSONL, `dpjax.mining`) read for training, and sampled:
`HardNegatives` picks `per_example` of them for each example of a batch (random other training
passages without a gold answer when a question has fewer) and returns the windows to add as
N_hard."""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Sequence

import numpy as np

from dpjax import metrics
from dpjax.data.squad import JSON_ERRORS, Question
from dpjax.data.windows import PassageWindows
from dpjax.errors import DataError

log = logging.getLogger(__name__)


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
