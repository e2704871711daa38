"""`run.py serve`: the workdir's index served over HTTP until SIGINT or SIGTERM (`dpjax.serve`).
"""
from __future__ import annotations

import gc
import logging
import signal

import uvicorn

from dpjax.loading import reread_scorer
from dpjax.main import open_searcher
from dpjax.serve import bind, make_service
from dpjax.serve.auth import api_key, check_exposure
from dpjax.settings import Settings

log = logging.getLogger(__name__)


def run(settings: Settings, workdir: str) -> None:
  """`run.py serve`: serves the workdir's index until SIGINT or SIGTERM (the port is taken before
  the index loads, so a port in use fails at once; `serve.port=0`: a free one, logged). A host
  other machines reach needs an API key or `serve.allow_open` (check_exposure). On a signal it
  stops accepting, answers the requests it holds (for at most `serve.shutdown_timeout_s`) and
  returns."""
  sc = settings.serve
  key = api_key(sc)
  check_exposure(sc.host, key, sc.allow_open)
  with bind(sc.host, sc.port) as sock:
    app, batcher = service(settings, workdir)
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


def service(settings: Settings, workdir):
  """(app, started batcher) of `make_service` over the workdir's index (`serve.index` or
  `index.search_index`), loaded (and with `index.verify` checked) as the config describes it."""
  index_name = settings.serve.index or settings.index.search_index
  searcher, step = open_searcher(settings, workdir, index_name, verify=settings.index.verify)
  return make_service(settings.serve, searcher, step, workdir, model_name=settings.model.name,
                      index_name=index_name, max_answer_length=settings.eval.max_answer_length,
                      reread_scored_by=reread_scorer(settings.eval, settings.index))


def _interrupt(signum, frame):
  raise KeyboardInterrupt
