"""Micro-batching: one search thread takes every request waiting when it is free (up to
`serve.max_batch` questions, waiting at most `serve.max_wait_ms` for more), encodes their
questions in one call of the jitted question encoder, then searches the index once per distinct
(k, unit). RequestError is a refused request's status and reason."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

import numpy as np

from dpjax.serve.metrics import ServiceMetrics

log = logging.getLogger(__name__)
_STOP = object()  # tells the search thread to end


class RequestError(ValueError):
  """A request the service refuses: its HTTP status and a one-line reason."""

  def __init__(self, status: int, reason: str):
    super().__init__(reason)
    self.status = status


@dataclasses.dataclass
class _Job:
  """A request waiting for the search thread: its questions, k and unit, the future its answer
  is set on, and when it was queued (`time.perf_counter`)."""
  questions: list[str]
  k: int
  unit: str
  future: concurrent.futures.Future
  received: float


class Batcher:
  """Runs searches on one thread, the requests waiting when it is free as one micro-batch."""

  def __init__(self, searcher, *, max_batch: int = 64, max_wait_ms: float = 2.0,
               max_queue: int = 1024, max_answer_length: int = 10):
    self.searcher, self.max_batch = searcher, max_batch
    self.max_wait, self.max_answer_length = max_wait_ms / 1000, max_answer_length
    self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
    self._carry: _Job | None = None  # taken from the queue but over the last batch's cap
    self.metrics = ServiceMetrics(max_batch)
    self.metrics.watch_queue(self._queue.qsize)
    self._thread = threading.Thread(target=self._loop, name="dpjax-search", daemon=True)

  def start(self) -> "Batcher":
    self._thread.start()
    return self

  def stop(self, timeout: float | None = None) -> None:
    """Ends the search thread once it has answered every request queued before this call (a
    search still running after `timeout` seconds is left to end with the process)."""
    if self._thread.is_alive():
      self._queue.put(_STOP)
      self._thread.join(timeout)
      if self._thread.is_alive():
        log.warning("the search thread did not end within %.0f s", timeout)

  def submit(self, questions: list[str], k: int, unit: str) -> concurrent.futures.Future:
    """A future of the top-k units of each question (lists of result dicts)."""
    job = _Job(questions, k, unit, concurrent.futures.Future(), time.perf_counter())
    try:
      self._queue.put_nowait(job)
    except queue.Full:
      raise RequestError(503, f"{self._queue.maxsize} requests are waiting; try again") from None
    return job.future

  def _next_batch(self) -> list[_Job] | None:
    """The next micro-batch (None: stop): the first waiting request, then those that arrive
    within max_wait while the batch has room; a request that does not fit starts the next."""
    first = self._carry if self._carry is not None else self._queue.get()
    self._carry = None
    if first is _STOP:
      return None
    batch, size = [first], len(first.questions)
    deadline = time.perf_counter() + self.max_wait
    while size < self.max_batch:
      try:
        job = self._queue.get(timeout=max(deadline - time.perf_counter(), 1e-6))
      except queue.Empty:
        break
      if job is _STOP or size + len(job.questions) > self.max_batch:
        self._carry = job
        break
      batch.append(job)
      size += len(job.questions)
    return batch

  def _loop(self) -> None:
    while (batch := self._next_batch()) is not None:
      start = time.perf_counter()
      try:
        results = self.search(batch)
      except Exception:  # one request may have broken the batch: the others still get answers
        log.exception("search failed for a batch of %d requests; retrying them one by one",
                      len(batch))
        results = [self._alone(job) for job in batch]
      now = time.perf_counter()
      self.metrics.searched_batch(sum(len(job.questions) for job in batch),
                                  [now - job.received for job in batch], now - start)
      for job, result in zip(batch, results):
        if not job.future.set_running_or_notify_cancel():  # its request went away meanwhile
          continue
        if isinstance(result, Exception):
          job.future.set_exception(result)
        else:
          job.future.set_result(result)

  def _alone(self, job: _Job):
    """The job's results searched by themselves, or the exception that fails it."""
    try:
      return self.search([job])[0]
    except Exception as e:
      log.exception("search failed for %d questions", len(job.questions))
      return e

  def search(self, batch: list[_Job]) -> list[list[list[dict]]]:
    """Per job, per question, the result dicts: one encoding, one index search per (k, unit)."""
    questions = [q for job in batch for q in job.questions]
    q_start, q_end = self.searcher.encode(questions)
    offsets = np.cumsum([0] + [len(job.questions) for job in batch])
    groups: dict[tuple[int, str], list[int]] = {}
    for i, job in enumerate(batch):
      groups.setdefault((job.k, job.unit), []).append(i)
    results: list = [None] * len(batch)
    index = self.searcher.index
    for (k, unit), members in groups.items():
      rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])
      found = index.search(q_start[rows], q_end[rows], k, unit,
                           max_answer_length=self.max_answer_length,
                           texts=[questions[r] for r in rows.tolist()])
      at = 0
      for i in members:
        n = len(batch[i].questions)
        results[i] = [[index.result(p, unit) for p, _ in units] for units in found[at:at + n]]
        at += n
    return results

  def stats(self) -> dict:
    """`/stats`: the metrics' counts, micro-batches and latencies as one JSON object."""
    return self.metrics.stats()
