"""Hybrid search: dense phrase scores fused with their passages' and sentences' BM25 scores, and
the merging of overlapping spans into one answer.

A question's candidate phrases are the phrase index's (`PhraseIndex.search`'s dense spans) and
the spans of the top `passages` BM25 passages, scored exactly as an exhaustive search over each
such passage's tokens scores them (every token as a start paired with its best end, and as an end
with its best start). Every candidate gets

    fused = dense score + weight x BM25(question, its passage)
                        + sentence_weight x BM25(question, the sentence it starts in)

with raw BM25 scores (not normalised: the terms are sums of evidence on scales fixed per index
and model, so weights chosen on held-out questions fit them, as Pyserini's dense-sparse fusion
adds raw scores). The sentence's score tells apart the passages of one article, which share
most of the question's words, by where the words sit (its effect on held-out training
questions: `results/fusion_terms.md`); it is BM25 over the sentence's terms with the sentences'
idf (`SparseIndex.sentence_scores`), computed for the candidates' sentences only. Weights of 0
are the dense search itself, without BM25's candidates.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Sequence

import numpy as np

from dpjax.errors import DumpError
from dpjax.index.rescoring import Rescorer
from dpjax.index.sparse import SparseIndex
from dpjax.index.units import count

# Bounds the [questions, anchors, max_answer_length] arrays of one exhaustive rescoring.
_EXHAUSTIVE_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class Hybrid:
  """Hybrid search's options: the dump's BM25 index, the weights of its passage and sentence
  scores, and how many top BM25 passages add their spans to the candidates.

  `Hybrid.recorded(sparse)` takes the weights `run.py index` chose and recorded in the BM25
  index. Weights of 0 and 0 make the search the dense one (`active` is False).
  """
  sparse: SparseIndex
  weight: float
  sentence_weight: float = 0.0
  passages: int = 20

  def __post_init__(self):
    for name in ("weight", "sentence_weight"):
      value = getattr(self, name)
      if (not isinstance(value, numbers.Real) or isinstance(value, bool)
          or not math.isfinite(value)):
        raise ValueError(f"hybrid search's {name} must be a finite number, got {value!r}")
      object.__setattr__(self, name, float(value))  # (frozen: set once, here)
    count(self.passages, "index.sparse_passages")

  @classmethod
  def recorded(cls, sparse: SparseIndex, *, passages: int = 20) -> "Hybrid":
    """The weights recorded in the BM25 index (`run.py index` chose them)."""
    if sparse.weight is None or sparse.sentence_weight is None:
      raise DumpError(f"{sparse.directory} records no hybrid weights: choose them with "
                      "`run.py index --set index.sparse=True` (it tunes them) or set "
                      "index.sparse_weight")
    return cls(sparse, sparse.weight, sparse.sentence_weight, passages)

  @classmethod
  def of(cls, sparse: SparseIndex, weight: float | None = None,
         sentence_weight: float | None = None, *, passages: int = 20) -> "Hybrid":
    """Given weights, or without `weight` the recorded ones; `sentence_weight` defaults to 0
    beside a given `weight` and is refused without one (which pair would it complete?)."""
    if weight is None:
      if sentence_weight is not None:
        raise ValueError("a sentence weight without the passage weight: give both, or "
                         "neither (the BM25 index's recorded ones)")
      return cls.recorded(sparse, passages=passages)
    return cls(sparse, weight, sentence_weight or 0.0, passages)

  @property
  def active(self) -> bool:
    """Whether BM25 changes the search (a weight is not 0)."""
    return bool(self.weight or self.sentence_weight)

  def record(self) -> dict:
    """What eval and the service report of it."""
    return {"weight": self.weight, "sentence_weight": self.sentence_weight,
            "passages": self.passages}


def top_passages(lexical: np.ndarray, count: int) -> list[np.ndarray]:
  """Per question (row of [Q, P] BM25 scores), its top `count` passage rows with a score > 0
  (a passage sharing no term with the question is no lexical evidence), best first."""
  count = min(count, lexical.shape[1])
  if count < 1:
    return [np.zeros(0, np.int64) for _ in lexical]
  part = np.argpartition(-lexical, count - 1, axis=1)[:, :count]
  out = []
  for row, picks in zip(lexical, part):
    # Every passage tied with the last one picked competes, so ties go to the lower row (a
    # canonical order, not the partition's).
    picks = np.flatnonzero(row >= row[picks].min())
    picks = picks[np.lexsort((picks, -row[picks]))][:count]
    out.append(picks[row[picks] > 0].astype(np.int64))
  return out


def lexical_spans(rescorer: Rescorer, q_start: np.ndarray, q_end: np.ndarray,
                  passages: Sequence[np.ndarray], max_answer_length: int,
                  ) -> list[tuple[np.ndarray, ...]]:
  """Per question, (starts, ends, dense scores) of every best span of the tokens of its
  `passages` (rows), as an exhaustive search over those tokens finds them (`Rescorer.rescore`
  with every token the index keeps as a start hit and as an end hit: its spans, in its order,
  bit for bit); -inf spans left out. Each token is scored once (`_best_partners`)."""
  layouts = [rescorer.passage_layout(rows) for rows in passages]
  out: list = [None] * len(layouts)
  # Widest first: a call's rows are sized by its first, widest row; similar widths share a call.
  order = np.argsort([-total for _, _, total in layouts], kind="stable")
  at = 0
  while at < len(order):
    width = max(layouts[order[at]][2], 1)
    chunk = max(1, _EXHAUSTIVE_ELEMENTS // (2 * width * max_answer_length))
    rows = order[at:at + chunk]
    found = _best_partners(rescorer, q_start[rows], q_end[rows],
                           [(passages[q], *layouts[q]) for q in rows], max_answer_length)
    for q, spans in zip(rows, found):
      out[q] = spans
    at += len(rows)
  return out


def _best_partners(rescorer: Rescorer, q_start: np.ndarray, q_end: np.ndarray, layouts: list,
                   length: int) -> list[tuple[np.ndarray, ...]]:
  """`lexical_spans` of questions whose passages (rows, their kept tokens, slots, slots in all:
  `Rescorer.passage_layout`) are laid out end to end, L = `length` slots of padding each side:
  each token's start and end scores in its slot (-inf where a token is not kept), then every
  start's best end and every end's best start at distances 0..L-1 within its passage, the
  nearest on ties, as `Rescorer.rescore` finds them."""
  rows, width = len(layouts), max(max(total for *_, total in layouts), 1)
  start = np.full((rows, width + 2 * length), -np.inf, np.float32)
  end, passage = start.copy(), np.full(start.shape, -1, np.int64)
  token = np.zeros(start.shape, np.int64)
  place = None if rescorer.positions is None else np.zeros(start.shape, np.int64)
  columns = max(max(len(tokens) for _, tokens, _, _ in layouts), 1)
  anchors = np.zeros((rows, columns), np.int64)
  for i, (passage_rows, tokens, slots, _) in enumerate(layouts):
    anchors[i, :len(tokens)] = tokens
    sizes = rescorer.passage_end[passage_rows] - rescorer.passage_start[passage_rows]
    passage[i, length:length + sizes.sum()] = np.repeat(np.arange(len(sizes)), sizes)
    token[i, length + slots] = tokens
    if place is not None:
      place[i, length + slots] = np.asarray(rescorer.positions[tokens], np.int64)
  scores_s, scores_e = rescorer.token_scores(anchors, q_start, q_end)  # [R, columns]
  for i, (_, tokens, slots, _) in enumerate(layouts):
    start[i, length + slots] = scores_s[i, :len(tokens)]
    end[i, length + slots] = scores_e[i, :len(tokens)]
  here = slice(length, length + width)
  best = {}
  for direction in (1, -1):  # starts look forward to their end, ends back to their start
    top = np.full((rows, width), -np.inf, np.float32)
    partner = np.zeros((rows, width), np.int64)
    for distance in range(length):
      there = slice(length + direction * distance, length + direction * distance + width)
      total = (start[:, here] + end[:, there]) if direction == 1 else (start[:, there]
                                                                      + end[:, here])
      ok = (passage[:, there] == passage[:, here]) & (passage[:, here] >= 0)
      if place is not None:
        ok &= np.abs(place[:, there] - place[:, here]) < length
      better = ok & (total > top)
      top = np.where(better, total, top)
      partner = np.where(better, token[:, there], partner)
    best[direction] = top, partner
  (top_s, end_of), (top_e, start_of) = best[1], best[-1]
  out = []
  for i, (_, tokens, slots, _) in enumerate(layouts):
    spans = (np.concatenate([tokens, start_of[i, slots]]),
             np.concatenate([end_of[i, slots], tokens]),
             np.concatenate([top_s[i, slots], top_e[i, slots]]))
    keep = np.isfinite(spans[2])
    out.append(tuple(a[keep] for a in spans))
  return out


@dataclasses.dataclass
class Candidates:
  """One question's distinct candidate spans before fusion: (starts, ends, dense scores) and
  their passages' BM25 [N], the parts of `fuse` no weight changes (a grid of weights ranks the
  same candidates many times); their sentences' BM25 once a sentence weight asks for it."""
  starts: np.ndarray
  ends: np.ndarray
  scores: np.ndarray
  passage_bm25: np.ndarray
  sentence_bm25: np.ndarray | None = None


def candidates(dense: tuple[np.ndarray, ...], lexical: tuple[np.ndarray, ...], bm25: np.ndarray,
               token_passage: np.ndarray) -> Candidates:
  """The distinct spans of the phrase index's (`dense`) and the BM25 passages' (`lexical`)
  candidates, each (starts, ends, dense scores); bm25: [P] the question's BM25 of every passage.
  A span both found is kept once, at its dense place."""
  starts = np.concatenate([dense[0], lexical[0]]).astype(np.int64)
  ends = np.concatenate([dense[1], lexical[1]]).astype(np.int64)
  scores = np.concatenate([dense[2], lexical[2]]).astype(np.float32)
  keys = starts * len(token_passage) + ends
  first = np.sort(np.unique(keys, return_index=True)[1])
  starts = starts[first]
  return Candidates(starts, ends[first], scores[first], bm25[token_passage[starts]])


def ranked(found: Candidates, weight: float,
           sentence_bm25: Callable[[np.ndarray], np.ndarray] | None = None,
           sentence_weight: float = 0.0) -> tuple[np.ndarray, ...]:
  """(starts, ends, fused scores) of `found` best first (ties in their order: the dense
  search's first); sentence_bm25: start tokens [N] -> [N] the question's BM25 of the sentence
  each starts in, called once for `found` (kept in it)."""
  def sentences() -> np.ndarray:
    if found.sentence_bm25 is None:
      found.sentence_bm25 = sentence_bm25(found.starts)
    return found.sentence_bm25
  fused = fused_scores(found.scores, found.passage_bm25, weight, sentences, sentence_weight)
  order = np.argsort(-fused, kind="stable")
  return found.starts[order], found.ends[order], fused[order]


def fuse(dense: tuple[np.ndarray, ...], lexical: tuple[np.ndarray, ...], bm25: np.ndarray,
         token_passage: np.ndarray, weight: float,
         sentence_bm25: Callable[[np.ndarray], np.ndarray] | None = None,
         sentence_weight: float = 0.0) -> tuple[np.ndarray, ...]:
  """One question's distinct candidate spans, (starts, ends, fused scores) best first
  (`candidates`, then `ranked`).

  dense / lexical: (starts, ends, dense scores) of the phrase index's spans and of the BM25
  passages' spans; bm25: [P] the question's BM25 score of every passage; sentence_bm25 (with a
  sentence_weight): start tokens [N] -> [N] the question's BM25 of the sentence each starts in.
  A span both found is kept once (at its dense place: ties in rank keep the dense search's order
  first).
  """
  return ranked(candidates(dense, lexical, bm25, token_passage), weight, sentence_bm25,
                sentence_weight)


def fused_scores(scores: np.ndarray, passage_bm25: np.ndarray, weight: float,
                 sentence_bm25: Callable[[], np.ndarray] | None = None,
                 sentence_weight: float = 0.0) -> np.ndarray:
  """[N] candidates' dense scores + weight x their passages' BM25 [N] + sentence_weight x
  their sentences' (`sentence_bm25()`, computed only with a sentence weight)."""
  fused = scores + np.float32(weight) * passage_bm25
  if sentence_weight:
    fused = fused + np.float32(sentence_weight) * sentence_bm25()
  return fused


def overlap_groups(starts: np.ndarray, ends: np.ndarray, k: int) -> tuple[list[int], list[list]]:
  """Ranked spans (token ids, best first) grouped by overlap: up to k groups, each led by its
  best span, with the positions of the lower-ranked spans that overlap the lead (spans of one
  passage sharing a token: token ids are global, so they share a passage). Returns (leads,
  others per lead)."""
  leads: list[int] = []
  bounds: list[tuple[int, int]] = []
  others: list[list[int]] = []
  for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
    for group, (lead_start, lead_end) in enumerate(bounds):
      if s <= lead_end and lead_start <= e:
        others[group].append(i)
        break
    else:
      if len(leads) == k:
        break
      leads.append(i)
      bounds.append((s, e))
      others.append([])
  return leads, others
