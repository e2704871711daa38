"""The service of `run.py serve` (dpjax/main/serve.py): the index loaded and its searches compiled
ahead (make_service); start_server runs an app on a thread (the tests, the benchmarks)."""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from dpjax import __version__
from dpjax.errors import ConfigError
from dpjax.index.device_search import DeviceFlat
from dpjax.index.units import UNITS
from dpjax.serve.app import create_app
from dpjax.serve.auth import api_key, is_loopback
from dpjax.serve.batching import Batcher
from dpjax.serve.parsing import MAX_BODY, Limits
from dpjax.index.search import PhraseSearcher
from dpjax.settings import ServeSettings

log = logging.getLogger(__name__)


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


def make_service(serve: ServeSettings, searcher: PhraseSearcher, step: int | None, workdir, *,
                 model_name: str, index_name: str, max_answer_length: int,
                 reread_scored_by: str | None = None) -> tuple[FastAPI, Batcher]:
  """(app, started batcher) over `searcher` (the workdir's index `index_name`, its model
  `model_name` at checkpoint `step`; `reread_scored_by`: the checkpoint whose question encoder
  scores re-read spans, if not that one), the question encoder compiled ahead for every call shape
  a micro-batch may take; with an API key (`api_key`) its data routes need it, without one on a
  loopback `serve.host` it answers only requests to a loopback name."""
  sc = serve
  key = api_key(sc)
  start = time.perf_counter()  # every shape of its calls: no compile while serving
  shapes = searcher.compile(sc.max_batch)
  log.info("encoders compiled for %d call shapes (up to %d questions) in %.1f s", shapes,
           sc.max_batch, time.perf_counter() - start)
  if isinstance(searcher.index.index, DeviceFlat):  # the exact index on the accelerator: each width
    start = time.perf_counter()  # a search of up to max_k units may fetch, compiled ahead
    widths = searcher.index.index.warm(searcher.index.fetch_bounds(sc.max_k)[1])
    log.info("device search compiled for %d widths in %.1f s", widths,
             time.perf_counter() - start)
  batcher = Batcher(searcher, max_batch=sc.max_batch, max_wait_ms=sc.max_wait_ms,
                    max_queue=sc.max_queue, max_answer_length=max_answer_length)
  index = searcher.index
  info = {"model": model_name, "model_step": step, "index": index_name, "dump": str(index.dump.directory),
          "workdir": str(workdir), "vectors": int(index.num_vectors),
          "passages": int(index.dump.manifest["num_passages"]), "units": list(UNITS),
          "max_k": sc.max_k, "max_questions": sc.max_questions,
          "max_question_chars": sc.max_question_chars, "max_body_bytes": MAX_BODY,
          "max_batch": sc.max_batch, "merge_spans": index.merge_spans,
          "reread": 0 if index.reread is None else index.reread.passages,
          "reread_margin": None if index.reread is None else index.reread.margin,
          "reread_window": None if index.reread is None else index.reread.window,
          "reread_scored_by": reread_scored_by,
          "version": __version__,
          "hybrid": None if index.hybrid is None else index.hybrid.record()}
  return create_app(batcher.start(), Limits.from_config(sc), info, key,
                    loopback_hosts_only=not key and is_loopback(sc.host)), batcher
