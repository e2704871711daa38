"""`run.py serve`: an HTTP search service (FastAPI + uvicorn) over a workdir's index.

- `GET /search?q=...&k=10&unit=passage` (q repeatable) and `POST /search` with JSON
  `{"question": "..."}` or `{"questions": [...]}` plus optional `k` and `unit`: the top-k units
  (phrase, sentence, passage, document), each with its answer phrase, score, passage id, row and
  title, the passage text and the answer's character span in it (as `DensePhrases.search`).
- `GET /health` (the index, its size, the model's step), `GET /info` (model, checkpoint step,
  index, units and the limits a client must respect, version), `GET /metrics` (Prometheus),
  `GET /stats` (a JSON view of the same counters), `GET /` a search page, `GET /docs` the
  OpenAPI docs of the schema at `/openapi.json` (Swagger UI served from DOCS_ASSETS, not a CDN:
  the docs work without internet).
- Micro-batching: one search thread takes every request waiting when it is free (up to
  `serve.max_batch` questions, waiting at most `serve.max_wait_ms` for more) and encodes their
  questions in one call of the jitted question encoder, then searches the index once per distinct
  (k, unit); so throughput grows with the number of concurrent clients.
- Access: with an API key (`serve.api_key` or the environment variable `serve.api_key_env`
  names, at least MIN_KEY_CHARS characters) every data route needs `Authorization: Bearer <key>`;
  without one the service listens on loopback only, unless `serve.allow_open`, and there answers
  only requests whose Host header is a loopback name (LoopbackHostOnly: a DNS-rebinding guard).
- Bad requests get a 4xx and one line `{"error": "..."}`; a search that fails answers 500 for
  its requests only, with a request id the server log holds beside the cause; a full queue
  answers 503. Nothing a client sends stops the server. SIGTERM or SIGINT: it stops accepting,
  answers the requests it holds, and exits.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import queue
import re
import secrets
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from dpjax import __version__
from dpjax.errors import ConfigError

try:  # the service's own dependencies are an extra of the install
  import uvicorn
  from fastapi import FastAPI, Request
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import HTMLResponse, JSONResponse, Response
  from fastapi_offline import FastAPIOffline
  from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                                 Histogram, Info, generate_latest)
  from pydantic import BaseModel, ConfigDict, Field
  from starlette.exceptions import HTTPException
  from starlette.requests import ClientDisconnect
except ImportError as e:  # missing, or a version without what is imported (pydantic 1)
  raise ConfigError(f"the service cannot import {e.name or 'its dependencies'} ({e}): "
                    "pip install 'dpjax[serve]'") from None
from dpjax.index.device_search import DeviceFlat
from dpjax.index.units import UNITS
from dpjax.workdir import load_searcher

log = logging.getLogger("dpjax.serve")
MAX_BODY = 1 << 20  # bytes of a POST body
MIN_KEY_CHARS = 16  # an API key's least length: a short one is guessed by trying
_STOP = object()  # tells the search thread to end


class RequestError(ValueError):
  """A request the service refuses: its HTTP status and a one-line reason."""

  def __init__(self, status: int, reason: str):
    super().__init__(reason)
    self.status = status


@dataclasses.dataclass
class Limits:
  max_k: int = 100
  max_questions: int = 64
  max_question_chars: int = 1000

  @classmethod
  def from_config(cls, serve) -> "Limits":
    return cls(serve.max_k, serve.max_questions, serve.max_question_chars)


def _integer(value, name: str) -> int:
  if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,18}\s*", value):  # ASCII digits
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 10 ** 18:
    raise RequestError(400, f"{name} must be an integer, got {str(value)[:40]!r}")
  return value


def parse_search(payload: dict, limits: Limits) -> tuple[list[str], bool, int, str]:
  """(questions, single, k, unit) of a search request's fields, or a RequestError."""
  unknown = sorted(set(payload) - {"question", "questions", "q", "k", "unit"})
  if unknown:
    raise RequestError(400, f"unknown field(s) {unknown}; expected question or questions, "
                            "k, unit")
  given = [name for name in ("question", "questions", "q") if name in payload]
  if len(given) != 1:
    raise RequestError(400, "give exactly one of question (a string) or questions (a list)")
  value = payload[given[0]]
  single = isinstance(value, str)
  questions = [value] if single else value
  if not isinstance(questions, list) or not all(isinstance(q, str) for q in questions):
    raise RequestError(400, f"{given[0]} must be a string or a list of strings")
  if not questions or len(questions) > limits.max_questions:
    raise RequestError(400 if not questions else 413, f"{len(questions)} questions: give 1 to "
                       f"{limits.max_questions} per request")
  for i, question in enumerate(questions):
    if not question.strip():
      raise RequestError(400, f"question {i} is empty")
    if len(question) > limits.max_question_chars:
      raise RequestError(413, f"question {i} has {len(question)} characters; the limit is "
                              f"{limits.max_question_chars}")
    try:
      question.encode("utf-8")
    except UnicodeEncodeError as e:  # e.g. a lone surrogate from a JSON \ud800 escape
      raise RequestError(400, f"question {i} is not valid Unicode ({e.reason})") from None
  k = _integer(payload.get("k", 10), "k")
  if not 1 <= k <= limits.max_k:
    raise RequestError(400, f"k = {k}: must be between 1 and {limits.max_k}")
  unit = payload.get("unit", "phrase")
  if unit not in UNITS:
    raise RequestError(400, f"unknown unit {unit!r}; one of {', '.join(UNITS)}")
  return questions, single, k, unit


# The API's shapes, as the OpenAPI schema at /openapi.json documents them. parse_search, not
# pydantic, reads a request (its refusals name the field and the limit in one line), and answers
# are written as they are (FastAPI's encoder would walk every result in Python first); the
# tests check that the schema's examples are served and that answers fit these models.
Unit = Literal[UNITS]
EXAMPLE_RESULT = {"answer": "Romulus", "score": 21.4, "start_char": 0, "end_char": 7,
                  "passage_id": "1832", "passage_row": 1831, "title": "Rome",
                  "passage": "Romulus founded the city in 753 BC."}


class SearchRequest(BaseModel):
  """POST /search: one question or a list of them (give exactly one), k and the unit."""
  model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
      {"question": "who founded the city?", "k": 3, "unit": "passage"},
      {"questions": ["who founded the city?", "when was it built?"], "k": 5}]})
  question: str | None = Field(None, description="a question; the answer has `question` and "
                               "`results`, one list")
  questions: list[str] | None = Field(None, description="questions (1 to serve.max_questions); "
                                      "the answer has `questions` and one list of results each")
  k: int = Field(10, ge=1, description="results per question (1 to serve.max_k)")
  unit: Unit = Field("phrase", description="what a result is: the answer phrase, or its "
                     "sentence, passage or document (the best phrase of each)")


class Evidence(BaseModel):
  """An answer span merged into a better one it overlaps (`index.merge_spans`)."""
  answer: str
  score: float
  start_char: int
  end_char: int


class Result(BaseModel):
  """A retrieved unit, as `DensePhrases.search` returns it."""
  model_config = ConfigDict(json_schema_extra={"examples": [EXAMPLE_RESULT]})
  answer: str = Field(description="the answer phrase")
  score: float
  start_char: int = Field(description="the answer's span in `passage`, in code points")
  end_char: int
  passage_id: str
  passage_row: int = Field(description="the passage's row in the dump")
  title: str
  passage: str
  sentence: str | None = Field(None, description="the answer's sentence (unit sentence only)")
  merged: list[Evidence] | None = Field(None, description="lower-scoring answers overlapping "
                                        "this one in its passage, merged into it (phrase unit)")


class OneAnswer(BaseModel):
  """The answer to one question (`question` in the request, or one `q`)."""
  question: str
  results: list[Result]
  k: int
  unit: Unit
  seconds: float = Field(description="time from the request's queueing to its answer")


class ManyAnswers(BaseModel):
  """The answers to a list of questions, one list of results each, in their order."""
  questions: list[str]
  results: list[list[Result]]
  k: int
  unit: Unit
  seconds: float


class ErrorAnswer(BaseModel):
  """A refused request or a failed search: one line saying why."""
  model_config = ConfigDict(json_schema_extra={"examples": [{"error": "k = 0: must be between "
                                                                      "1 and 100"}]})
  error: str
  request_id: str | None = Field(None, description="a failed search's id (500 only): the "
                                 "server log names the cause beside it")


class Health(BaseModel):
  """GET /health (open to all, also with an API key)."""
  status: Literal["ok"]
  index: str
  vectors: int
  passages: int
  model_step: int | None = Field(description="the checkpoint step (null: untrained weights)")
  auth: bool = Field(description="whether the data routes need `Authorization: Bearer <key>`")


class ServiceInfo(BaseModel):
  """GET /info: what is served and the limits a client must respect."""
  model: str = Field(description="the encoder (the config's model.name)")
  model_step: int | None = Field(description="the checkpoint step (null: untrained weights)")
  index: str = Field(description="the index folder under <dump>/indexes")
  dump: str
  workdir: str
  vectors: int
  passages: int
  units: list[Unit]
  max_k: int
  max_questions: int = Field(description="questions per request")
  max_question_chars: int
  max_body_bytes: int = Field(description="the largest POST body")
  max_batch: int = Field(description="questions per micro-batch")
  hybrid: dict | None = Field(None, description="hybrid search's BM25 weight and passages "
                              "(index.sparse; null: the dense search)")
  merge_spans: bool = Field(True, description="overlapping answers of one passage merged")
  version: str = Field(description="dpjax's version")


class Stats(BaseModel):
  """GET /stats: a JSON view of /metrics' counters; `refused_<status>` for each status other
  than 200 answered; latency quantiles estimated from the latency histogram's buckets."""
  model_config = ConfigDict(extra="allow")
  uptime_s: float
  requests: int = Field(description="requests searched (answered or failed)")
  questions: int
  batches: int
  largest_batch: int
  client_disconnects: int
  waiting: int = Field(description="requests in the queue")
  mean_batch_questions: float
  questions_per_s: float
  latency_p50_ms: float | None
  latency_p99_ms: float | None


_ERRORS = {status: {"model": ErrorAnswer, "description": text} for status, text in (
    (400, "a malformed request: the error names the field"),
    (413, "too many questions, a question or a body too long"),
    (415, "a body that is not application/json"),
    (500, "the search failed: the answer's request_id finds the cause in the server log"),
    (503, "the queue is full: try again"))}
_SEARCH_EXAMPLES = {"one": {"summary": "one question", "value": {
                        "question": "who founded the city?", "k": 3, "unit": "passage"}},
                    "many": {"summary": "several questions", "value": {
                        "questions": ["who founded the city?", "when was it built?"], "k": 5}}}
_POST_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": SearchRequest.model_json_schema(), "examples": _SEARCH_EXAMPLES}}}}
_GET_QUERY = {"parameters": [
    {"name": "q", "in": "query", "required": True, "style": "form", "explode": True,
     "description": "a question; repeat q for several (the answer then has `questions`)",
     "schema": {"type": "array", "items": {"type": "string"}},
     "example": ["who founded the city?"]},
    {"name": "k", "in": "query", "description": "results per question (1 to serve.max_k)",
     "schema": {"type": "integer", "minimum": 1, "default": 10}},
    {"name": "unit", "in": "query", "schema": {"type": "string", "enum": list(UNITS),
                                               "default": "phrase"}}]}


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


@dataclasses.dataclass
class _Job:
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


def _error(status: int, reason: str) -> JSONResponse:
  return JSONResponse({"error": reason}, status_code=status)


async def _payload(request: Request) -> dict:
  """The search fields of a GET query string or a POST JSON body (a RequestError if malformed)."""
  if request.method == "GET":
    try:  # (Starlette's query_params put U+FFFD for bytes that are not UTF-8)
      pairs = urllib.parse.parse_qsl(request.scope["query_string"].decode("latin-1"),
                                     keep_blank_values=True, errors="strict")
    except UnicodeDecodeError as e:
      raise RequestError(400, f"the query string is not UTF-8 ({e.reason})") from None
    fields: dict[str, list[str]] = {}
    for name, value in pairs:
      fields.setdefault(name, []).append(value)
    repeated = sorted(name for name, v in fields.items() if name != "q" and len(v) > 1)
    if repeated:
      raise RequestError(400, f"{repeated} given more than once (only q may repeat)")
    return {name: (v if name == "q" and len(v) > 1 else v[0]) for name, v in fields.items()}
  kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
  if kind != "application/json":
    raise RequestError(415, f"content type {kind or 'none'!r}: send application/json")
  declared = request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > MAX_BODY:  # refused before reading it
    raise RequestError(413, f"body of {declared} bytes; the limit is {MAX_BODY}")
  body = bytearray()
  async for chunk in request.stream():  # a chunked body has no length to refuse it by
    body += chunk
    if len(body) > MAX_BODY:
      raise RequestError(413, f"body of more than {MAX_BODY} bytes (the limit)")
  try:
    payload = json.loads(bytes(body))
  except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a huge number, deep nesting
    raise RequestError(400, f"malformed JSON: {type(e).__name__}: {str(e)[:200]}") from None
  if not isinstance(payload, dict):
    raise RequestError(400, "the body must be a JSON object")
  return payload


# Where the docs page's Swagger UI files are served (FastAPIOffline mounts fastapi-offline's copy).
DOCS_ASSETS = "/docs/assets"
# Served to anyone, also with an API key: the health check, and the pages a browser opens
# without a way to attach a header (the search page and the docs with the files they load, which
# ask for the key and send it with each request they make).
OPEN_PATHS = frozenset({"/health", "/", "/docs", "/docs/oauth2-redirect", "/openapi.json",
                        *(f"{DOCS_ASSETS}/{name}" for name in ("swagger-ui-bundle.js",
                                                               "swagger-ui.css", "favicon.png"))})


class LoopbackHostOnly:
  """ASGI middleware of a keyless service on loopback: a request whose Host header is not a
  loopback name (localhost, a 127.x.x.x or ::1 address, with any port) gets a 403 with one line
  (counted in the metrics). Otherwise a web page of any site could name the service by a host
  of its own that its DNS then points at 127.0.0.1 (DNS rebinding), and read its answers."""

  def __init__(self, app, *, metrics: ServiceMetrics):
    self.app, self.metrics = app, metrics

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http":
      # No Host at all (HTTP/1.0) is let through: a browser always sends one.
      foreign = [value for name, value in scope["headers"]
                 if name == b"host" and not _LOOPBACK_HOST.fullmatch(value)]
      if foreign:
        self.metrics.request(403)
        host = foreign[0].decode("latin-1")[:100]
        response = JSONResponse({"error": f"Host {host!r} is not a loopback name: without an "
                                          "API key this service answers only requests to "
                                          "localhost, 127.0.0.1 or [::1]"}, status_code=403)
        return await response(scope, receive, send)
    return await self.app(scope, receive, send)


_LOOPBACK_HOST = re.compile(rb"(localhost|127(\.[0-9]{1,3}){3}|\[::1\])(:[0-9]{1,5})?",
                            re.IGNORECASE)


class BearerAuth:
  """ASGI middleware: a request to a path outside OPEN_PATHS needs `Authorization: Bearer <key>`,
  or gets a 401 with one line (counted in the metrics). The keys' SHA-256 digests are compared
  by hmac.compare_digest, in a time that tells nothing of the key."""

  def __init__(self, app, *, key: str, metrics: ServiceMetrics):
    self.app, self.metrics = app, metrics
    self.digest = hashlib.sha256(key.encode()).digest()

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
      reason = self.refusal(dict(scope["headers"]).get(b"authorization"))
      if reason:
        self.metrics.request(401)
        response = JSONResponse({"error": reason}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return await response(scope, receive, send)
    return await self.app(scope, receive, send)

  def refusal(self, header: bytes | None) -> str | None:
    """Why a request with this Authorization header is refused; None: it is not."""
    if header is None:
      return "this service needs its API key: send Authorization: Bearer <key>"
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer":
      return "send the API key as Authorization: Bearer <key>"
    if not hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest):
      return "wrong API key"
    return None


def api_key(serve) -> str:
  """The key the service requires ('' for none): `serve.api_key`, or the value of the environment
  variable `serve.api_key_env` names, which keeps the key out of command lines and config files.
  A ConfigError if both are set and differ, if the key cannot be sent in a header, or if it is
  shorter than MIN_KEY_CHARS."""
  env = serve.api_key_env
  from_env = os.environ.get(env, "") if env else ""
  if serve.api_key and from_env and serve.api_key != from_env:
    raise ConfigError(f"serve.api_key and ${env} are both set and differ: give the key once")
  key = serve.api_key or from_env
  where = "serve.api_key" if serve.api_key else "$" + env
  if key and not re.fullmatch(r"[!-~]+", key):
    raise ConfigError(f"the API key ({where}) must be printable ASCII without spaces")
  if key and len(key) < MIN_KEY_CHARS:
    raise ConfigError(f"the API key ({where}) has {len(key)} characters; give at least "
                      f"{MIN_KEY_CHARS}, e.g. python -c 'import secrets; "
                      "print(secrets.token_urlsafe(24))'")
  return key


def check_exposure(host: str, key: str, allow_open: bool) -> None:
  """Refuses (a ConfigError) to listen where other machines reach the service without a key:
  a host that is not this machine's loopback (0.0.0.0, a LAN address) needs an API key, or
  `serve.allow_open` set on purpose."""
  if key or allow_open or _loopback(host):
    return
  raise ConfigError(f"serve.host {host!r} is reachable from other machines and no API key is "
                    "set: put one in the environment variable serve.api_key_env names "
                    "(DPJAX_API_KEY by default) or in serve.api_key, or --set "
                    "serve.allow_open=True to serve anyone on purpose")


def _loopback(host: str) -> bool:
  """Whether every address `host` names is a loopback address (localhost, 127.0.0.1, ::1)."""
  try:
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    return all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)
  except (OSError, ValueError):  # not a name or an address of any machine
    return False


def create_app(batcher: Batcher, limits: Limits, info: dict, key: str = "", *,
               loopback_hosts_only: bool = False) -> FastAPI:
  """The service's routes over a started Batcher (`info`: what /info reports, ServiceInfo's
  fields); with an API key (`key`), every route outside OPEN_PATHS needs it (BearerAuth).
  `loopback_hosts_only` (a keyless service on loopback) refuses requests whose Host header is
  not a loopback name (LoopbackHostOnly)."""
  metrics = batcher.metrics
  metrics.describe(info)
  app = _offline_docs_app()
  health = {"status": "ok", "auth": bool(key),
            **{name: info[name] for name in ("index", "vectors", "passages", "model_step")}}
  search = _search_route(batcher, limits)
  described = {"response_model": OneAnswer | ManyAnswers, "responses": _ERRORS,
               "summary": "The top-k units of one or more questions"}
  app.get("/search", openapi_extra=_GET_QUERY, operation_id="search_get", **described)(search)
  app.post("/search", openapi_extra=_POST_BODY, operation_id="search_post", **described)(search)

  @app.get("/health", response_model=Health)
  async def health_check():
    """Whether the service is up, what it serves; open to all, also with an API key."""
    return health

  @app.get("/info", response_model=ServiceInfo)
  async def service_info():
    """The model, index, units and limits a client must respect, and dpjax's version."""
    return info

  @app.get("/stats", response_model=Stats)
  async def stats():
    """A JSON view of /metrics' counters."""
    return JSONResponse(batcher.stats())

  @app.get("/metrics", response_class=Response, responses={200: {
      "description": "Prometheus' text format", "content": {"text/plain": {}}}})
  async def prometheus_metrics():
    """Requests and questions by status, micro-batch sizes, queue depth, latency histograms,
    index size, in Prometheus' text format."""
    return Response(metrics.exposition(), media_type=metrics.content_type)

  @app.get("/", response_class=HTMLResponse)
  async def page():
    """The search page."""
    return PAGE

  @app.exception_handler(HTTPException)
  async def http_error(request, e):  # 404, 405: the same one-line shape
    metrics.request(e.status_code)
    return _error(e.status_code, str(e.detail))

  @app.exception_handler(RequestValidationError)
  async def invalid(request, e):
    metrics.request(422)
    return _error(422, "; ".join(str(err.get("msg")) for err in e.errors()))

  _limit_access(app, metrics, key, loopback_hosts_only)
  return app


def _offline_docs_app() -> FastAPI:
  """A FastAPI app whose /docs page loads Swagger UI from the files fastapi-offline ships,
  mounted at DOCS_ASSETS, not from a CDN that a machine without internet never reaches (the page
  was blank there)."""
  return FastAPIOffline(title="dpjax", version=__version__, redoc_url=None,
                        static_url=DOCS_ASSETS,
                        description="Dense phrase retrieval: the top-k phrases, sentences, "
                                    "passages or documents of questions over an indexed corpus.")


def _limit_access(app: FastAPI, metrics: ServiceMetrics, key: str,
                  loopback_hosts_only: bool) -> None:
  """With a key, BearerAuth on every route outside OPEN_PATHS (and the schema says so); without
  one, `loopback_hosts_only`: LoopbackHostOnly on every route."""
  if key:
    app.add_middleware(BearerAuth, key=key, metrics=metrics)
    _document_auth(app)
  elif loopback_hosts_only:
    app.add_middleware(LoopbackHostOnly, metrics=metrics)


def _search_route(batcher: Batcher, limits: Limits):
  """GET and POST /search: a request's questions searched in the next micro-batch, or refused
  with its status and one line; each counted by status in the metrics."""
  metrics = batcher.metrics

  async def search(request: Request) -> Response:
    questions: list[str] = []
    try:
      questions, single, k, unit = parse_search(await _payload(request), limits)
      empty = batcher.searcher.empty_questions(questions)
      if empty:  # refused alone, not failing the micro-batch it would join
        raise RequestError(400, f"question {empty[0]} is empty (only characters the tokenizer "
                                "drops)")
      start = time.perf_counter()
      results = await asyncio.wrap_future(batcher.submit(questions, k, unit))
    except ClientDisconnect:  # the client left while sending its request: no one to answer
      metrics.client_disconnect()
      return Response(status_code=400)
    except RequestError as e:
      metrics.request(e.status, len(questions))
      return _error(e.status, str(e))
    except Exception as e:  # the search failed: its cause is for the log, not the client
      metrics.request(500, len(questions))
      request_id = secrets.token_hex(8)
      log.error("request %s: the search failed: %s: %s", request_id, type(e).__name__, e,
                exc_info=e)
      return JSONResponse({"error": f"the search failed (request id {request_id}); the server "
                                    "log has the cause", "request_id": request_id},
                          status_code=500)
    metrics.request(200, len(questions))
    answer = {"k": k, "unit": unit, "seconds": time.perf_counter() - start}
    # A JSONResponse as is: FastAPI's encoder would walk every result in Python first.
    if single:
      return JSONResponse({"question": questions[0], "results": results[0], **answer})
    return JSONResponse({"questions": questions, "results": results, **answer})

  return search


def _document_auth(app: FastAPI) -> None:
  """The schema declares the bearer key and the 401 on every route outside OPEN_PATHS (the
  docs' Authorize button then sends it)."""
  generate = app.openapi

  def openapi() -> dict:
    if app.openapi_schema is None:
      schema = generate()
      schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
      for path, operations in schema["paths"].items():
        if path in OPEN_PATHS:
          continue
        for operation in operations.values():
          operation["security"] = [{"bearer": []}]
          operation["responses"]["401"] = {
              "description": "no or a wrong API key",
              "content": {"application/json": {"schema": {
                  "$ref": "#/components/schemas/ErrorAnswer"}}}}
    return app.openapi_schema

  app.openapi = openapi


def bind(host: str, port: int) -> socket.socket:
  """A socket listening on (host, port) (port 0: a free one, `getsockname()[1]`) for the server;
  a port in use or a host not of this machine is a ConfigError naming them. It listens at once
  (connections wait in its backlog until the server runs): a socket only bound would let another
  program bind and listen on the port meanwhile (SO_REUSEADDR), and the server would never serve."""
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
    sock.listen(2048)  # uvicorn's default backlog
  except (OSError, OverflowError) as e:  # in use, not this machine's address; port > 65535
    sock.close()
    cause = getattr(e, "strerror", None) or e
    raise ConfigError(f"serve.host {host!r}, serve.port {port}: cannot listen there ({cause}); "
                      "pick another port (--set serve.port=..., 0: any free one) or stop the "
                      "server already using it") from None
  return sock


def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0):
  """Runs `app` on a background thread; returns (server, thread, port) (port 0: a free one).
  `server.should_exit = True` then `thread.join()` stops it."""
  sock = bind(host, port)
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  while not server.started and thread.is_alive():
    time.sleep(0.01)
  return server, thread, sock.getsockname()[1]


def make_service(config, workdir) -> tuple[FastAPI, Batcher]:
  """(app, started batcher) over the workdir's index (`serve.index` or `index.search_index`),
  the question encoder compiled ahead for every call shape a micro-batch may take; with an API
  key (`api_key`) its data routes need it, without one on a loopback `serve.host` it answers
  only requests to a loopback name."""
  sc = config.serve
  key = api_key(sc)
  searcher, step = load_searcher(config, workdir, sc.index or None,
                                 verify=config.index.verify)
  start = time.perf_counter()  # every shape of its calls: no compile while serving
  shapes = searcher.compile(sc.max_batch)
  log.info("question encoder compiled for %d call shapes (up to %d questions) in %.1f s", shapes,
           sc.max_batch, time.perf_counter() - start)
  if isinstance(searcher.index.index, DeviceFlat):  # the exact index on the accelerator: each width
    start = time.perf_counter()  # a search of up to max_k units may fetch, compiled ahead
    widths = searcher.index.index.warm(searcher.index.fetch_bounds(sc.max_k)[1])
    log.info("device search compiled for %d widths in %.1f s", widths,
             time.perf_counter() - start)
  batcher = Batcher(searcher, max_batch=sc.max_batch, max_wait_ms=sc.max_wait_ms,
                    max_queue=sc.max_queue, max_answer_length=config.eval.max_answer_length)
  index = searcher.index
  info = {"model": config.model.name, "model_step": step,
          "index": sc.index or config.index.search_index, "dump": str(index.dump.directory),
          "workdir": str(workdir), "vectors": int(index.num_vectors),
          "passages": int(index.dump.manifest["num_passages"]), "units": list(UNITS),
          "max_k": sc.max_k, "max_questions": sc.max_questions,
          "max_question_chars": sc.max_question_chars, "max_body_bytes": MAX_BODY,
          "max_batch": sc.max_batch, "merge_spans": index.merge_spans, "version": __version__,
          "hybrid": None if index.hybrid is None else index.hybrid.record()}
  return create_app(batcher.start(), Limits.from_config(sc), info, key,
                    loopback_hosts_only=not key and _loopback(sc.host)), batcher


def run_serve(config, workdir: str) -> None:
  """`run.py serve`: serves the workdir's index until SIGINT or SIGTERM (the port is taken before
  the index loads, so a port in use fails at once; `serve.port=0`: a free one, logged). A host
  other machines reach needs an API key or `serve.allow_open` (check_exposure). On a signal it
  stops accepting, answers the requests it holds (for at most `serve.shutdown_timeout_s`) and
  returns."""
  sc = config.serve
  key = api_key(sc)
  check_exposure(sc.host, key, sc.allow_open)
  with bind(sc.host, sc.port) as sock:
    app, batcher = make_service(config, workdir)
    # What loading made (the model, the tokenizer, the passages) lives as long as the service:
    # moved out of the collector's generations, a full collection no longer walks it and
    # stalls every request in flight (results/serve_soak.md).
    gc.collect()
    gc.freeze()
    host = f"[{sc.host}]" if ":" in sc.host else sc.host
    url = f"http://{host}:{sock.getsockname()[1]}/"
    log.info("serving %s on %s (%s; Ctrl-C or SIGTERM stops)", workdir, url,
             "API key required" if key else "no API key")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                           timeout_graceful_shutdown=sc.shutdown_timeout_s))
    # uvicorn stops gracefully on SIGINT and SIGTERM, then raises the signal again for the
    # handler it found: SIGTERM's default would then kill the process (status -15), so SIGTERM
    # ends it as Ctrl-C does instead.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
      server.run(sockets=[sock])
    except KeyboardInterrupt:
      pass
    finally:
      signal.signal(signal.SIGTERM, previous)
      batcher.stop(timeout=sc.shutdown_timeout_s)
  if not server.started:  # uvicorn logged why
    raise OSError(f"the server on {url} did not start")
  log.info("stopped")


def _interrupt(signum, frame):
  raise KeyboardInterrupt


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dpjax search</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 16px/1.5 system-ui, sans-serif; max-width: 56rem; margin: 2rem auto;
        padding: 0 1rem; }
 form { display: flex; gap: .5rem; flex-wrap: wrap; }
 #question { flex: 1 1 24rem; font-size: 1.1rem; padding: .4rem .6rem; }
 select, button { font-size: 1rem; padding: .4rem; }
 .result { border-top: 1px solid #ddd; padding: .6rem 0; }
 .answer { font-weight: 600; font-size: 1.1rem; }
 .meta { color: #666; font-size: .85rem; }
 mark { background: #ffe066; padding: 0 .1rem; }
 #status { color: #666; margin: .8rem 0; } .error { color: #b00020; }
</style></head>
<body>
<h1>dpjax phrase search</h1>
<form id="form">
 <input id="question" name="question" placeholder="Ask a question" autocomplete="off" autofocus>
 <select id="unit"><option>phrase</option><option>sentence</option><option>passage</option>
 <option>document</option></select>
 <select id="k"><option>1</option><option>5</option><option selected>10</option></select>
 <input id="key" type="password" placeholder="API key" autocomplete="off" hidden>
 <button type="submit" id="go">Search</button>
</form>
<div id="status"></div><div id="results"></div>
<script>
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function show(r, rank) {
  const div = el("div", "result");
  div.appendChild(el("div", "answer", rank + ". " + r.answer));
  div.appendChild(el("div", "meta", r.title + " \\u00b7 passage " + r.passage_id +
                                    " \\u00b7 score " + r.score.toFixed(2)));
  const p = el("p", "passage");
  const chars = Array.from(r.passage);  // code points, as the offsets count them (not UTF-16)
  p.appendChild(document.createTextNode(chars.slice(0, r.start_char).join("")));
  p.appendChild(el("mark", "", chars.slice(r.start_char, r.end_char).join("")));
  p.appendChild(document.createTextNode(chars.slice(r.end_char).join("")));
  div.appendChild(p);
  return div;
}
// With an API key (/health says so, or a search is refused with 401) the page asks for it and
// sends it with each search; the tab keeps it (sessionStorage) across reloads.
function askForKey() { $("key").hidden = false; }
$("key").value = sessionStorage.getItem("dpjax-key") || "";
fetch("health").then((r) => r.json()).then((h) => { if (h.auth) askForKey(); }, () => {});
$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = {question: $("question").value, k: Number($("k").value), unit: $("unit").value};
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) {
    headers["Authorization"] = "Bearer " + $("key").value;
    sessionStorage.setItem("dpjax-key", $("key").value);
  }
  $("status").textContent = "searching\\u2026"; $("status").className = "";
  $("results").replaceChildren();
  try {
    const response = await fetch("search", {method: "POST", body: JSON.stringify(body), headers});
    const data = await response.json();
    if (response.status === 401) askForKey();
    if (!response.ok) throw new Error(data.error || response.statusText);
    $("status").textContent = data.results.length + " results in " +
        (1000 * data.seconds).toFixed(0) + " ms";
    data.results.forEach((r, i) => $("results").appendChild(show(r, i + 1)));
  } catch (e) {
    $("status").textContent = e.message; $("status").className = "error";
  }
});
</script>
</body></html>
"""
