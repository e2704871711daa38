"""`run.py serve`: an HTTP search service (FastAPI + uvicorn) over a workdir's index.

- `GET /search?q=...&k=10&unit=passage` (q repeatable) and `POST /search` with JSON
  `{"question": "..."}` or `{"questions": [...]}` plus optional `k` and `unit`: the top-k units
  (phrase, sentence, passage, document), each with its answer phrase, score, passage id, row and
  title, the passage text and the answer's character span in it (as `DensePhrases.search`).
- `GET /health` (the index, its size, the model's step), `GET /stats` (requests, questions,
  micro-batches, latency p50/p99, refused requests by status), `GET /` a search page.
- Micro-batching: one search thread takes every request waiting when it is free (up to
  `serve.max_batch` questions, waiting at most `serve.max_wait_ms` for more) and encodes their
  questions in one call of the jitted question encoder, then searches the index once per distinct
  (k, unit); so throughput grows with the number of concurrent clients.
- Bad requests get a 4xx and one line `{"error": "..."}`; a search that fails answers 500 for
  its requests only; a full queue answers 503. Nothing a client sends stops the server.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import queue
import re
import socket
import threading
import time
import urllib.parse

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from dpjax.errors import ConfigError
from dpjax.index.device_search import DeviceFlat
from dpjax.index.search import UNITS
from dpjax.workdir import load_searcher

log = logging.getLogger("dpjax.serve")
MAX_BODY = 1 << 20  # bytes of a POST body
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
    self._lock = threading.Lock()
    self.counts = collections.Counter()
    self.latencies: collections.deque = collections.deque(maxlen=10_000)
    self.started = time.time()
    self._thread = threading.Thread(target=self._loop, name="dpjax-search", daemon=True)

  def start(self) -> "Batcher":
    self._thread.start()
    return self

  def stop(self) -> None:
    if self._thread.is_alive():
      self._queue.put(_STOP)
      self._thread.join()

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
      try:
        results = self.search(batch)
      except Exception:  # one request may have broken the batch: the others still get answers
        log.exception("search failed for a batch of %d requests; retrying them one by one",
                      len(batch))
        results = [self._alone(job) for job in batch]
      self._record(batch)
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
                           max_answer_length=self.max_answer_length)
      at = 0
      for i in members:
        n = len(batch[i].questions)
        results[i] = [[index.result(p, unit) for p, _ in units] for units in found[at:at + n]]
        at += n
    return results

  def _record(self, batch: list[_Job]) -> None:
    now = time.perf_counter()
    with self._lock:
      self.counts.update(requests=len(batch), batches=1,
                         questions=sum(len(job.questions) for job in batch))
      self.counts["largest_batch"] = max(self.counts["largest_batch"],
                                         sum(len(job.questions) for job in batch))
      self.latencies.extend(now - job.received for job in batch)

  def refused(self, status: int) -> None:
    self.count(f"refused_{status}")

  def count(self, what: str) -> None:
    with self._lock:
      self.counts[what] += 1

  def stats(self) -> dict:
    with self._lock:
      counts, latencies = dict(self.counts), np.array(self.latencies)
    uptime = time.time() - self.started
    batches = counts.get("batches", 0)
    return {"uptime_s": uptime, **counts, "waiting": self._queue.qsize(),
            "mean_batch_questions": counts.get("questions", 0) / batches if batches else 0.0,
            "questions_per_s": counts.get("questions", 0) / uptime if uptime else 0.0,
            "latency_p50_ms": float(np.percentile(latencies, 50) * 1e3) if len(latencies) else None,
            "latency_p99_ms": float(np.percentile(latencies, 99) * 1e3) if len(latencies) else None}


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


def create_app(batcher: Batcher, limits: Limits, info: dict) -> FastAPI:
  """The service's routes over a started Batcher (`info`: what /health reports)."""
  app = FastAPI(title="dpjax", docs_url=None, redoc_url=None, openapi_url=None)

  @app.api_route("/search", methods=["GET", "POST"])
  async def search(request: Request):
    try:
      questions, single, k, unit = parse_search(await _payload(request), limits)
      empty = batcher.searcher.empty_questions(questions)
      if empty:  # refused alone, not failing the micro-batch it would join
        raise RequestError(400, f"question {empty[0]} is empty (only characters the tokenizer "
                                "drops)")
      start = time.perf_counter()
      results = await asyncio.wrap_future(batcher.submit(questions, k, unit))
    except ClientDisconnect:  # the client left while sending its request: no one to answer
      batcher.count("client_disconnects")
      return Response(status_code=400)
    except RequestError as e:
      batcher.refused(e.status)
      return _error(e.status, str(e))
    except Exception as e:  # the search failed (logged by the search thread)
      batcher.refused(500)
      return _error(500, f"search failed: {type(e).__name__}: {e}")
    answer = {"k": k, "unit": unit, "seconds": time.perf_counter() - start}
    # A JSONResponse as is: FastAPI's encoder would walk every result in Python first.
    if single:
      return JSONResponse({"question": questions[0], "results": results[0], **answer})
    return JSONResponse({"questions": questions, "results": results, **answer})

  @app.get("/health")
  async def health():
    return {"status": "ok", **info}

  @app.get("/stats")
  async def stats():
    return batcher.stats()

  @app.get("/", response_class=HTMLResponse)
  async def page():
    return PAGE

  @app.exception_handler(HTTPException)
  async def http_error(request, e):  # 404, 405: the same one-line shape
    batcher.refused(e.status_code)
    return _error(e.status_code, str(e.detail))

  @app.exception_handler(RequestValidationError)
  async def invalid(request, e):
    batcher.refused(422)
    return _error(422, "; ".join(str(err.get("msg")) for err in e.errors()))

  return app


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
  the question encoder compiled ahead for every call shape a micro-batch may take."""
  sc = config.serve
  searcher, step = load_searcher(config, pathlib.Path(workdir), sc.index or None,
                                 verify=config.index.get("verify", True))
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
  info = {"workdir": str(workdir), "index": sc.index or config.index.search_index,
          "dump": str(index.dump.directory), "vectors": int(index.num_vectors),
          "passages": int(index.dump.manifest["num_passages"]), "model_step": step,
          "max_k": sc.max_k, "max_questions": sc.max_questions, "units": list(UNITS)}
  return create_app(batcher.start(), Limits.from_config(sc), info), batcher


def run_serve(config, workdir: str) -> None:
  """`run.py serve`: serves the workdir's index until interrupted (the port is taken before the
  index loads, so a port in use fails at once; `serve.port=0`: a free one, logged)."""
  host = config.serve.host
  with bind(host, config.serve.port) as sock:
    app, batcher = make_service(config, workdir)
    url = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}/"
    log.info("serving %s on %s (Ctrl-C stops)", workdir, url)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
      server.run(sockets=[sock])
    except KeyboardInterrupt:  # the SIGINT (SIGTERM) uvicorn raises again once it has stopped
      pass
    finally:
      batcher.stop()
  if not server.started:  # uvicorn logged why
    raise OSError(f"the server on {url} did not start")


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
$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = {question: $("question").value, k: Number($("k").value), unit: $("unit").value};
  $("status").textContent = "searching\\u2026"; $("status").className = "";
  $("results").replaceChildren();
  try {
    const response = await fetch("search", {method: "POST", body: JSON.stringify(body),
                                            headers: {"Content-Type": "application/json"}});
    const data = await response.json();
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
