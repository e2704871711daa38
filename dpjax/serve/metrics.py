"""The service's counters (ServiceMetrics): what /metrics exposes in Prometheus' text format and
/stats as JSON, and the latency quantiles /stats estimates from a histogram's buckets."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               Info, generate_latest)

# Latency buckets from a millisecond up, each bound sqrt(2) times the last: /stats' p50 and p99,
# estimated from these buckets, are within a factor of sqrt(2) of the true values.
LATENCY_BUCKETS = tuple(0.001 * 2 ** (i / 2) for i in range(30))


class ServiceMetrics:
  """The service's counters, kept once: requests and questions by status, micro-batch sizes,
  queue depth, latencies, index size. /metrics exposes them in Prometheus' text format, /stats is
  a JSON view of the same values. prometheus_client writes the format as Prometheus' own parser
  reads it (escaping, histogram buckets), in a registry of each service's own, so several
  services in one process (the tests) count apart."""

  content_type = CONTENT_TYPE_LATEST

  def __init__(self, max_batch: int = 64):
    self.registry = registry = CollectorRegistry()
    self.started = time.time()
    self.requests = Counter("dpjax_requests", "HTTP requests by status: every /search request "
                            "and every refused request on any route", ["status"],
                            registry=registry)
    self.questions = Counter("dpjax_questions", "Questions of /search requests by the request's "
                             "status (one refused before its questions were read counts none)",
                             ["status"], registry=registry)
    self.searched = Counter("dpjax_searched_requests", "Requests the search thread searched "
                            "(answered or failed)", registry=registry)
    self.disconnects = Counter("dpjax_client_disconnects", "Clients that hung up while sending "
                               "their request", registry=registry)
    sizes = sorted({2 ** i for i in range(max(max_batch, 1).bit_length())} | {max_batch})
    self.batch_questions = Histogram("dpjax_batch_questions", "Questions per micro-batch",
                                     buckets=sizes, registry=registry)
    self.largest_batch = Gauge("dpjax_largest_batch_questions", "Questions of the largest "
                               "micro-batch so far", registry=registry)
    self._largest = 0
    self.latency = Histogram("dpjax_request_latency_seconds", "A searched request's time from "
                             "its queueing to its answer", buckets=LATENCY_BUCKETS,
                             registry=registry)
    self.batch_seconds = Histogram("dpjax_batch_search_seconds", "Time to encode and search one "
                                   "micro-batch", buckets=LATENCY_BUCKETS, registry=registry)
    self.queue_depth = Gauge("dpjax_queue_depth", "Requests waiting for the search thread",
                             registry=registry)
    self.index_vectors = Gauge("dpjax_index_vectors", "Token vectors in the served index",
                               registry=registry)
    self.index_passages = Gauge("dpjax_index_passages", "Passages of the served index",
                                registry=registry)
    self.service = Info("dpjax_service", "The served model, index and dpjax version",
                        registry=registry)
    Gauge("dpjax_start_time_seconds", "When the service started (Unix time)",
          registry=registry).set(self.started)

  def watch_queue(self, depth: Callable[[], int]) -> None:
    """The queue depth, read at each scrape."""
    self.queue_depth.set_function(depth)

  def describe(self, info: dict) -> None:
    """The index size and the service's description from `/info`'s fields."""
    self.index_vectors.set(info["vectors"])
    self.index_passages.set(info["passages"])
    self.service.info({name: str(info[name]) for name in
                       ("version", "model", "model_step", "index")})

  def request(self, status: int, questions: int = 0) -> None:
    """A request answered or refused with `status`, of `questions` questions (0: unread)."""
    self.requests.labels(str(status)).inc()
    if questions:
      self.questions.labels(str(status)).inc(questions)

  def client_disconnect(self) -> None:
    self.disconnects.inc()

  def searched_batch(self, questions: int, latencies: Sequence[float], seconds: float) -> None:
    """A micro-batch searched: its questions, each request's latency, the search's time. Only
    the search thread calls it, so the largest batch is read and set without a race."""
    self.searched.inc(len(latencies))
    self.batch_questions.observe(questions)
    self._largest = max(self._largest, questions)
    self.largest_batch.set(self._largest)
    for latency in latencies:
      self.latency.observe(latency)
    self.batch_seconds.observe(seconds)

  def exposition(self) -> bytes:
    """Every metric in Prometheus' text format."""
    return generate_latest(self.registry)

  def value(self, name: str, **labels) -> float:
    return self.registry.get_sample_value(name, labels) or 0.0

  def stats(self) -> dict:
    """`/stats`: a JSON view of the metrics (refused_<status>: requests answered other than 200)."""
    uptime = time.time() - self.started
    batches = self.value("dpjax_batch_questions_count")
    questions = self.value("dpjax_batch_questions_sum")
    refused = {f"refused_{sample.labels['status']}": int(sample.value)
               for sample in self.requests.collect()[0].samples
               if sample.name == "dpjax_requests_total" and sample.labels["status"] != "200"}
    p50, p99 = (quantile(self.latency, q) for q in (0.5, 0.99))
    return {"uptime_s": uptime, "requests": int(self.value("dpjax_searched_requests_total")),
            "questions": int(questions), "batches": int(batches),
            "largest_batch": int(self.value("dpjax_largest_batch_questions")), **refused,
            "client_disconnects": int(self.value("dpjax_client_disconnects_total")),
            "waiting": int(self.value("dpjax_queue_depth")),
            "mean_batch_questions": questions / batches if batches else 0.0,
            "questions_per_s": questions / uptime if uptime else 0.0,
            "latency_p50_ms": None if p50 is None else p50 * 1e3,
            "latency_p99_ms": None if p99 is None else p99 * 1e3}


def quantile(histogram: Histogram, q: float) -> float | None:
  """The q-quantile of a histogram's observations, interpolated linearly within the bucket that
  holds it (as Prometheus' histogram_quantile); None before any observation."""
  buckets = [(float(s.labels["le"]), s.value) for s in histogram.collect()[0].samples
             if s.name.endswith("_bucket")]
  total = buckets[-1][1]
  if not total:
    return None
  rank, lower, below = q * total, 0.0, 0.0
  for bound, count in buckets:
    if count >= rank and count > below:
      if math.isinf(bound):  # past the last finite bound: that bound is all one can say
        return lower
      return lower + (bound - lower) * (rank - below) / (count - below)
    lower, below = bound, count
  return lower
