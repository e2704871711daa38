"""Exact rescoring of index hits (`Rescorer`): each start hit paired with its best end, each end
hit with its best start, scored from the token vectors.

An index search returns top start tokens for q_start and top end tokens for q_end; a phrase
[i, j] scores q_start . h_i + q_end . h_j. `Rescorer.rescore` pairs every start hit i with its
best end j in [i, i + max_answer_length) of the same passage (and every end hit with its best
start), both scored exactly (`scoring.token_scores`). A hit's best span depends on its question
and itself only, so hits rescored in pieces give exactly what they give rescored at once: the
shared hits of a search (`hits.Hits`) and hybrid search's exhaustive spans of BM25 passages
(`hybrid.lexical_spans`) rely on it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dpjax.index import scoring


class Rescorer:
  """The exact scores of phrases of a dump's tokens.

  Args:
    vectors: [N, D] token vectors, row = token id: the dump's (float16, converted a chunk at a
      time), an exact index's float32 storage or a compact index's codes
      (`compact.CodedVectors`, decoded a chunk at a time).
    token_passage: [N] the passage row of each token (sorted: a passage's tokens are
      contiguous), or a `TokenPassages` of the passages' offsets.
    num_passages: the passage rows (passages without tokens included).
    kept_mask: [N] the tokens a filtered index keeps (phrases start and end only there), or
      None for every token.
    positions: [N] the dump token id of each row, where the rows are a filter's kept tokens
      only: a phrase spans max_answer_length of the dump's tokens at most, as over the dump.
      Only differences within a passage count, so a row's place among its passage's dump tokens
      serves as well (a compact index's, `over_offsets`). None: the rows are the dump's tokens.
  """

  def __init__(self, vectors, token_passage: np.ndarray, num_passages: int,
               kept_mask: np.ndarray | None = None, positions: np.ndarray | None = None):
    self.vectors, self.token_passage, self.kept_mask = vectors, token_passage, kept_mask
    self.positions = positions
    if isinstance(token_passage, TokenPassages):  # the bounds are its offsets
      self.passage_start, self.passage_end = token_passage.offsets[:-1], token_passage.offsets[1:]
    else:
      rows = np.arange(num_passages)
      self.passage_start = np.searchsorted(token_passage, rows, "left")
      self.passage_end = np.searchsorted(token_passage, rows, "right")

  @classmethod
  def over_offsets(cls, vectors, offsets: np.ndarray,
                   positions: np.ndarray | None = None) -> "Rescorer":
    """The rescorer of rows numbered passage by passage, from the passages' first rows
    `offsets` [P + 1] alone (`TokenPassages`): no [N] array of passage rows is built, so
    memory-mapped offsets and `positions` (see the class) stay on disk but for what a rescoring
    reads (a compact index's)."""
    return cls(vectors, TokenPassages(offsets), len(offsets) - 1, positions=positions)

  @property
  def num_tokens(self) -> int:
    return len(self.token_passage)

  def token_scores(self, tokens: np.ndarray, q_start: np.ndarray, q_end: np.ndarray):
    """(start scores, end scores) of token ids [Q, ...] under their question's vectors."""
    return scoring.token_scores(self.vectors, tokens, q_start, q_end)

  def passage_tokens(self, passages: Sequence[int]) -> np.ndarray:
    """The token ids of passage rows `passages` (in their order) that phrases may use."""
    return self.passage_layout(passages)[0]

  def passage_layout(self, passages: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """(the token ids of passage rows `passages` that phrases may use, in their order; each
    one's slot in the passages' tokens laid end to end, kept or not; the slots in all)."""
    if not len(passages):
      return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    tokens = np.concatenate([np.arange(self.passage_start[p], self.passage_end[p])
                             for p in passages])
    slots, total = np.arange(len(tokens)), len(tokens)
    if self.kept_mask is not None:
      kept = self.kept_mask[tokens]
      tokens, slots = tokens[kept], slots[kept]
    return tokens, slots, total

  def rescore(self, q_start: np.ndarray, q_end: np.ndarray, starts: np.ndarray,
              ends: np.ndarray, max_answer_length: int):
    """The best span of every hit.

    Args:
      q_start, q_end: [Q, D] the questions' vectors.
      starts, ends: [Q, Ks], [Q, Ke] start and end hits (token ids, -1 for none).
      max_answer_length: the most tokens a phrase spans.

    Returns:
      (scores, span starts, span ends), [Q, Ks + Ke] each: the hits' best spans, start hits
      first, -inf where a hit is -1 or has no partner (the nearest partner on ties).
    """
    offsets = np.arange(max_answer_length)
    anchors = np.concatenate([starts, ends], 1)  # [Q, 2K]
    valid = anchors >= 0
    anchor = np.maximum(anchors, 0)
    forward = np.arange(anchors.shape[1]) < starts.shape[1]  # start anchors look forward
    partners = anchor[..., None] + np.where(forward[:, None], offsets, -offsets)  # [Q, 2K, L]
    passage = self.token_passage[anchor]
    ok = ((partners >= self.passage_start[passage][..., None])
          & (partners < self.passage_end[passage][..., None]) & valid[..., None])
    partners = np.clip(partners, 0, self.num_tokens - 1)
    if self.kept_mask is not None:  # filtered tokens are neither starts nor ends
      ok &= self.kept_mask[partners]
    if self.positions is not None:  # rows of kept tokens: the span's length in dump tokens
      # (signed: a compact index's places are unsigned 16-bit where they fit)
      ok &= (np.abs(np.asarray(self.positions[partners], np.int64)
                    - np.asarray(self.positions[anchor], np.int64)[..., None])
             < max_answer_length)
    span_start = np.where(forward[:, None], anchor[..., None], partners)
    span_end = np.where(forward[:, None], partners, anchor[..., None])
    # Every anchor is its own partner at offset 0: the partners' scores hold the anchors' too.
    score_s, score_e = self.token_scores(partners, q_start, q_end)  # [Q, 2K, L] each
    total = np.where(forward[:, None], score_s[..., :1] + score_e, score_s + score_e[..., :1])
    total = np.where(ok, total, -np.inf)
    best = total.argmax(-1)[..., None]
    scores = np.take_along_axis(total, best, -1)[..., 0]
    all_start = np.take_along_axis(span_start, best, -1)[..., 0]
    all_end = np.take_along_axis(span_end, best, -1)[..., 0]
    return scores, all_start, all_end


class TokenPassages:
  """The passage row of each row id where a passage's rows are contiguous, from the passages'
  first rows `offsets` [P + 1]: what the rescoring and the phrase index read of a
  `token_passage` array (its length, indexing by row ids) without its N entries."""

  def __init__(self, offsets: np.ndarray):
    self.offsets = offsets

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitem__(self, rows):
    """The passage rows of row ids `rows` (an int or an array of any shape)."""
    return np.searchsorted(self.offsets, rows, "right") - 1
