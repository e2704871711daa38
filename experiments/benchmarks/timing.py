"""Search timing shared by the benchmark scripts: searchers' `search` over the same batches of
questions, the searchers taking turns on each batch so that they all see the same machine."""
from __future__ import annotations

import statistics
import time

import numpy as np


def batches_of(questions: list, batch: int, batches: int, *, first: int = 0,
               wrap: bool = False) -> list[list]:
  """`batches` lists of `batch` consecutive questions from `first`: around the list again with
  `wrap`, else only as many as there are (the last list may be shorter)."""
  if wrap:
    return [[questions[(first + b * batch + j) % len(questions)] for j in range(batch)]
            for b in range(batches)]
  end = min(len(questions), first + batch * batches)
  return [questions[lo:min(lo + batch, end)] for lo in range(first, end, batch)]


def time_searches(searchers: dict, questions: list, batch: int, batches: int, *,
                  first: int = 0, wrap: bool = False, **search) -> dict:
  """{name: figures} of each searcher's `search(chunk, **search)` over `batches_of` the
  questions, the searchers in turn on each chunk. Figures: batch, batches, questions,
  questions_per_s (every question over every second), questions_per_s_median_batch (a full
  batch over the median batch's seconds), p50_ms, p90_ms, p99_ms (of a batch)."""
  chunks = batches_of(questions, batch, batches, first=first, wrap=wrap)
  seconds = {name: [] for name in searchers}
  for chunk in chunks:
    for name, searcher in searchers.items():
      start = time.perf_counter()
      searcher.search(chunk, **search)
      seconds[name].append(time.perf_counter() - start)
  asked = sum(map(len, chunks))
  out = {}
  for name, times in seconds.items():
    ms = 1000 * np.array(times)
    out[name] = {"batch": batch, "batches": len(times), "questions": asked,
                 "questions_per_s": asked / max(sum(times), 1e-12),
                 "questions_per_s_median_batch": batch / max(statistics.median(times), 1e-12),
                 **{f"p{p}_ms": float(np.percentile(ms, p)) for p in (50, 90, 99)}}
  return out
