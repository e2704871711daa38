"""The one retrieval evaluator: EM@k / F1@k of the top phrases and passage Top-k / MRR / P@k of
the top passages, over a `PhraseIndex`, for given question vectors.

Used by open-domain evaluation (`run.py eval`), validation on subcorpora, the token filter's
threshold sweep and query-side fine-tuning's dev scores.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from dpjax import metrics
from dpjax.io import Progress

log = logging.getLogger("dpjax.eval")
PROGRESS_CHUNK = 256  # questions searched between two progress updates

# What `retrieval_scores` reports with the default ks (validation.metric must be one of these).
METRICS = ("em@1", "f1@1", "em@10", "f1@10", "top1", "top5", "top20", "mrr@20", "p@20")


def retrieve(index, q_start: np.ndarray, q_end: np.ndarray, requests: Sequence[tuple[int, str]],
             *, shared_hits: bool = False, **search_kwargs) -> list[list[list]]:
  """For each (k, unit) request, the top-k units of every question as [(Phrase, key)].

  `shared_hits`: one index search, as wide as the widest request needs, serves all requests
  (`PhraseIndex.search(hits=)`); otherwise each request searches the index itself.
  `search_kwargs` go to `PhraseIndex.search` (max_answer_length, top_tokens, max_fetch).
  """
  hits = None
  if shared_hits:
    bounds = {k: search_kwargs.get(k) for k in ("top_tokens", "max_fetch")}
    width = max(index.fetch_bounds(k, **bounds)[unit != "phrase"] for k, unit in requests)
    hits = index.hits(q_start, q_end, width)
  return [index.search(q_start, q_end, k, unit, hits=hits, **search_kwargs)
          for k, unit in requests]


def retrieval_scores(index, q_start: np.ndarray, q_end: np.ndarray,
                     answers: Sequence[Sequence[str]], *, max_answer_length: int = 10,
                     phrase_k: int = 10, top_tokens: int | None = None, passage_k: int = 20,
                     passage_ks: Sequence[int] = (1, 5, 20), per_question: bool = False,
                     shared_hits: bool = False, found: list | None = None,
                     progress: bool = False, regex: bool = False) -> dict:
  """EM@1/EM@k (phrases, k = `phrase_k`) and, with `passage_k`, passage Top-k/MRR@k/P@k over
  a PhraseIndex.

  `per_question=True` adds `hits`: per question, whether its top phrase is an answer ("em@1")
  and whether a top-20 passage contains one ("top20"), as strings of 0/1 (paired tests).
  `found`: a list that receives the retrieved [phrases, passages] (predictions files).
  `progress`: show the search's progress and questions/s (256 questions at a time).
  `regex`: the answers are regular expressions (CuratedTREC): EM by `metrics.regex_match`, no
  F1, passages by a pattern search. MRR and P@ are at 20, or at `passage_k` when it is less.
  """
  requests = [(phrase_k, "phrase")] + ([(passage_k, "passage")] if passage_k else [])
  results: list[list] = [[] for _ in requests]
  bar = Progress("search", len(q_start), "questions", logger=log) if progress else None
  step = PROGRESS_CHUNK if progress else max(len(q_start), 1)  # questions are independent
  for at in range(0, len(q_start), step):
    part = retrieve(index, q_start[at:at + step], q_end[at:at + step], requests,
                    max_answer_length=max_answer_length, top_tokens=top_tokens,
                    shared_hits=shared_hits)
    for whole, piece in zip(results, part):
      whole.extend(piece)
    if bar:
      bar.update(len(part[0]))
  if bar:
    bar.close()
  if found is not None:
    found.extend(results)
  texts = [[p.text for p, _ in units] for units in results[0]]
  report = metrics.open_domain_scores(texts, answers, ks=sorted({1, phrase_k}), regex=regex)
  if per_question:
    match = metrics.regex_match if regex else metrics.exact_match
    report["hits"] = {"em@1": "".join(
        str(int(bool(t) and metrics.max_over_gold(match, t[0], golds) > 0))
        for t, golds in zip(texts, answers))}
  if passage_k:
    ranked = [[index.dump.passages[p.passage].text for p, _ in units] for units in results[1]]
    report.update(metrics.passage_scores(ranked, answers,
                                         ks=[k for k in passage_ks if k <= passage_k],
                                         mrr_k=min(20, passage_k),
                                         precision_k=min(20, passage_k), regex=regex))
    if per_question:
      report["hits"]["top20"] = "".join(
          str(int(any(metrics.has_answer(d, golds, regex) for d in docs[:20])))
          for docs, golds in zip(ranked, answers))
  return report
