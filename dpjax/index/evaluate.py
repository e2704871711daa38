"""The one retrieval evaluator: EM@k / F1@k of the top phrases and passage Top-k / MRR / P@k of
the top passages, over a `PhraseIndex`, for given question vectors.

Used by open-domain evaluation (`run.py eval`), validation on subcorpora, the token filter's
threshold sweep and query-side fine-tuning's dev scores.
"""
from __future__ import annotations

import concurrent.futures
import logging
import pathlib
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from dpjax import metrics
from dpjax.io import Progress, write_lines_atomic

log = logging.getLogger("dpjax.eval")
PROGRESS_CHUNK = 256  # questions searched between two progress updates
# The parts of a retrieval `retrieve_texts(timing=)` times: waiting for the question encoder's
# thread, the shared index search, the requests' searches given its hits.
RETRIEVAL_PARTS = ("encode_wait", "hits", "units")

# What `retrieval_scores` reports with the default ks (validation.metric must be one of these).
METRICS = ("em@1", "f1@1", "em@10", "f1@10", "top1", "top5", "top20", "mrr@20", "p@20")


def retrieve(index, q_start: np.ndarray, q_end: np.ndarray, requests: Sequence[tuple[int, str]],
             *, shared_hits: bool = False, timing: dict | None = None,
             **search_kwargs) -> list[list[list]]:
  """For each (k, unit) request, the top-k units of every question as [(Phrase, key)].

  `shared_hits`: one index search, as wide as the widest request needs, serves all requests
  (`PhraseIndex.search(hits=)`); otherwise each request searches the index itself.
  `timing`: a dict the seconds of the shared index search ("hits") and of the requests' searches
  ("units") are added to (`RETRIEVAL_PARTS`).
  `search_kwargs` go to `PhraseIndex.search` (max_answer_length, top_tokens, max_fetch, texts).
  """
  hits, start = None, time.perf_counter()
  if shared_hits:
    bounds = {k: search_kwargs.get(k) for k in ("top_tokens", "max_fetch")}
    width = max(index.fetch_bounds(k, **bounds)[unit != "phrase"] for k, unit in requests)
    hits = index.hits(q_start, q_end, width)
    start = _timed(timing, "hits", start)
  found = [index.search(q_start, q_end, k, unit, hits=hits, **search_kwargs)
           for k, unit in requests]
  _timed(timing, "units", start)
  return found


def _timed(timing: dict | None, part: str, start: float) -> float:
  """Adds the seconds since `start` to timing[part] (none: nothing); returns now."""
  now = time.perf_counter()
  if timing is not None:
    timing[part] = timing.get(part, 0.0) + now - start
  return now


def retrieve_texts(index, encode: Callable, texts: Sequence[str],
                   requests: Sequence[tuple[int, str]], *, chunk: int | None = None,
                   progress: bool = False, **search_kwargs) -> list[list[list]]:
  """`retrieve` of questions given as text, `encode(texts) -> (q_start, q_end)` called on
  `chunk` (default `PROGRESS_CHUNK`) of them at a time and pipelined: the next chunk is encoded
  in a worker thread while this one is searched, so the encoder's and the search's work share
  the cores that each alone leaves idle. `search_kwargs` as `retrieve`'s (shared_hits,
  max_answer_length, ...; its `timing` also gets the seconds spent waiting for the encoder)."""
  chunk = PROGRESS_CHUNK if chunk is None else chunk
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunk (questions encoded at a time) must be >= 1, got {chunk!r}")
  parts = [texts[lo:lo + chunk] for lo in range(0, len(texts), chunk)]

  def encoded():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      ahead = pool.submit(encode, parts[0]) if parts else None
      for i in range(len(parts)):
        waited = time.perf_counter()
        vectors = ahead.result()
        _timed(search_kwargs.get("timing"), "encode_wait", waited)
        if i + 1 < len(parts):
          ahead = pool.submit(encode, parts[i + 1])
        yield (*vectors, list(parts[i]))  # the texts too: hybrid search scores them with BM25

  return _retrieve_chunks(index, encoded(), len(texts), requests, progress, **search_kwargs)


def _retrieve_chunks(index, chunks: Iterable, total: int, requests: Sequence[tuple[int, str]],
                     progress: bool, **search_kwargs) -> list[list[list]]:
  """`retrieve` over (q_start, q_end) chunks of `total` questions, the results concatenated
  (questions are independent); `progress`: a bar of the questions searched and questions/s."""
  results: list[list] = [[] for _ in requests]
  bar = Progress("search", total, "questions", logger=log) if progress else None
  for q_start, q_end, *texts in chunks:  # (q_start, q_end) or (q_start, q_end, texts)
    if texts:
      search_kwargs["texts"] = texts[0]
    for whole, piece in zip(results, retrieve(index, q_start, q_end, requests, **search_kwargs)):
      whole.extend(piece)
    if bar:
      bar.update(len(q_start))
  if bar:
    bar.close()
  return results


def score_requests(phrase_k: int = 10, passage_k: int = 20) -> list[tuple[int, str]]:
  """The searches `found_scores` scores: top phrase_k phrases, top passage_k passages (if any)."""
  return [(phrase_k, "phrase")] + ([(passage_k, "passage")] if passage_k else [])


def retrieval_scores(index, q_start: np.ndarray, q_end: np.ndarray,
                     answers: Sequence[Sequence[str]], *, max_answer_length: int = 10,
                     phrase_k: int = 10, top_tokens: int | None = None, passage_k: int = 20,
                     passage_ks: Sequence[int] = (1, 5, 20), per_question: bool = False,
                     shared_hits: bool = False, found: list | None = None,
                     progress: bool = False, regex: bool = False) -> dict:
  """EM@1/EM@k (phrases, k = `phrase_k`) and, with `passage_k`, passage Top-k/MRR@k/P@k over
  a PhraseIndex (`score_requests` searched, then `found_scores`).

  `found`: a list that receives the retrieved [phrases, passages] (predictions files).
  `progress`: show the search's progress and questions/s (256 questions at a time).
  The other arguments: `found_scores`'s and `PhraseIndex.search`'s.
  """
  step = PROGRESS_CHUNK if progress else max(len(q_start), 1)
  chunks = ((q_start[at:at + step], q_end[at:at + step]) for at in range(0, len(q_start), step))
  results = _retrieve_chunks(index, chunks, len(q_start), score_requests(phrase_k, passage_k),
                             progress, max_answer_length=max_answer_length,
                             top_tokens=top_tokens, shared_hits=shared_hits)
  if found is not None:
    found.extend(results)
  return found_scores(index, results, answers, phrase_k=phrase_k, passage_k=passage_k,
                      passage_ks=passage_ks, per_question=per_question, regex=regex)


def found_scores(index, results: list[list[list]], answers: Sequence[Sequence[str]], *,
                 phrase_k: int = 10, passage_k: int = 20, passage_ks: Sequence[int] = (1, 5, 20),
                 per_question: bool = False, regex: bool = False) -> dict:
  """The scores of `score_requests(phrase_k, passage_k)`'s results (`retrieve`'s).

  `per_question=True` adds `hits`: per question, whether its top phrase is an answer ("em@1")
  and whether its top passage / a top-20 passage contains one ("top1", "top20"), as strings of
  0/1 (paired tests).
  `regex`: the answers are regular expressions (CuratedTREC): EM by `metrics.regex_match`, no
  F1, passages by a pattern search. MRR and P@ are at 20, or at `passage_k` when it is less.
  """
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
      for k in (1, 20):
        report["hits"][f"top{k}"] = "".join(
            str(int(any(metrics.has_answer(d, golds, regex) for d in docs[:k])))
            for docs, golds in zip(ranked, answers))
  return report


def trec_ids(ids, what: str) -> dict[str, str]:
  """Each of the distinct `ids` as a TREC run line's column: whitespace (a column separator)
  as '_', the others as they are. Raises ValueError naming two ids that would then be one."""
  columns: dict[str, str] = {}
  taken: dict[str, str] = {}
  for value in ids:
    if value in columns:
      continue
    column = "_".join(value.split()) or "_"
    if column in taken:
      raise ValueError(f"{what} ids {taken[column]!r} and {value!r} would both be {column!r} "
                       "(whitespace splits a TREC line)")
    columns[value], taken[column] = column, value
  return columns


def write_trec(path: pathlib.Path, questions, ranked) -> str | None:
  """The passage ranking as a TREC run file (`qid Q0 passage_id rank score dpjax`, as Pyserini
  writes), ids with whitespace rewritten (`trec_ids`, warned). Where that would make two ids
  one, no file (an earlier one is removed): returns why."""
  try:
    qids = trec_ids((q.id for q in questions), "question")
    pids = trec_ids((pid for passages in ranked for pid, _ in passages), "passage")
  except ValueError as e:
    path.unlink(missing_ok=True)
    log.error("%s not written: %s; the predictions file has every id as it is", path.name, e)
    return str(e)
  rewritten = sorted(k for k, v in (qids | pids).items() if k != v)
  write_lines_atomic(path, (f"{qids[q.id]} Q0 {pids[pid]} {rank} {score:.6f} dpjax\n"
                            for q, passages in zip(questions, ranked)
                            for rank, (pid, score) in enumerate(passages, 1)))
  if rewritten:
    log.warning("%s: %d question or passage ids hold whitespace, which splits a TREC line; "
                "written with '_' for it (e.g. %r); the predictions file has them as they are",
                path.name, len(rewritten), rewritten[0])
  return None
