"""The hits of an index search (`Hits`) and what rescoring them found: the rounds of a unit search
and the searches they serve (`PhraseSearcher.search_many`) rescore each hit once.
"""
from __future__ import annotations

import numpy as np

from dpjax.index import scoring
from dpjax.index.rescoring import Rescorer


class Hits(tuple):
  """(start token ids, end token ids) [Q, n] each of one index search (`PhraseIndex.hits`) of
  questions (q_start, q_end); it keeps what rescoring them found by `rescorer` (`rescored`), so
  the rounds of a unit search and the searches sharing it (`retrieve`) rescore each hit once."""

  def __new__(cls, starts: np.ndarray, ends: np.ndarray, q_start: np.ndarray, q_end: np.ndarray,
              rescorer: Rescorer):
    self = super().__new__(cls, (starts, ends))
    self.queries = (np.array(q_start, np.float32), np.array(q_end, np.float32))  # copies
    self.rescorer = rescorer
    self._rescored: dict[int, _Rescored] = {}  # by max_answer_length
    return self

  def rescored(self, max_answer_length: int) -> "_Rescored":
    if max_answer_length not in self._rescored:
      self._rescored[max_answer_length] = _Rescored(self, max_answer_length)
    return self._rescored[max_answer_length]


class _Rescored:
  """The best span of each start and end hit of a `Hits`, each hit rescored once, the first
  columns first, as searches ask for them. A hit's best span depends on its question and itself
  only (`Rescorer.rescore`), so the first f columns rescored in pieces are exactly those
  columns rescored at once."""

  def __init__(self, hits: Hits, max_answer_length: int):
    self.hits, self.max_answer_length = hits, max_answer_length
    num_q, width = hits[0].shape
    self.scores = np.full((num_q, 2, width), -np.inf, np.float32)  # of start hits, end hits
    self.partner = np.zeros((num_q, 2, width), np.int64)  # a hit's best span's other end
    self.done = np.zeros(num_q, np.int64)  # columns rescored, per question

  def spans(self, rows: np.ndarray, width: int) -> list[tuple[np.ndarray, ...]]:
    """Per row of `rows`, (starts, ends, scores) of its distinct spans from its first `width`
    start and end hits, best first."""
    width = min(width, self.hits[0].shape[1])
    self._rescore(rows, width)
    starts, ends = (h[rows, :width] for h in self.hits)
    partner = self.partner[rows, :, :width]
    return ranked_spans(self.scores[rows, :, :width].reshape(len(rows), -1),
                        np.concatenate([starts, partner[:, 1]], 1),
                        np.concatenate([partner[:, 0], ends], 1),
                        self.hits.rescorer.num_tokens)

  def _rescore(self, rows: np.ndarray, width: int) -> None:
    todo = rows[self.done[rows] < width]
    for done in np.unique(self.done[todo]):
      group, new = todo[self.done[todo] == done], width - done
      # Rescoring holds a few [queries, 2 new, max_answer_length] arrays: bound them.
      chunk = max(1, scoring.RESCORE_ELEMENTS // (2 * new * self.max_answer_length))
      for lo in range(0, len(group), chunk):
        part = group[lo:lo + chunk]
        scores, span_start, span_end = self.hits.rescorer.rescore(
            self.hits.queries[0][part], self.hits.queries[1][part],
            self.hits[0][part, done:width], self.hits[1][part, done:width],
            self.max_answer_length)
        self.scores[part, :, done:width] = scores.reshape(len(part), 2, new)
        self.partner[part, 0, done:width] = span_end[:, :new]
        self.partner[part, 1, done:width] = span_start[:, new:]
      self.done[group] = width


def ranked_spans(scores: np.ndarray, span_start: np.ndarray, span_end: np.ndarray,
                 num_tokens: int) -> list[tuple[np.ndarray, ...]]:
  """Per question (row of the [Q, H] arrays of its hits' best spans), (starts, ends, scores) of
  its distinct spans, best first (ties in hit order; a span several hits found, at its first
  place); spans scored -inf left out."""
  results = []
  for q in range(len(scores)):
    order = np.argsort(-scores[q], kind="stable")
    order = order[np.isfinite(scores[q, order])]
    spans = span_start[q, order].astype(np.int64) * num_tokens + span_end[q, order]
    order = order[np.sort(np.unique(spans, return_index=True)[1])]  # distinct, best first
    results.append((span_start[q, order], span_end[q, order], scores[q, order]))
  return results
