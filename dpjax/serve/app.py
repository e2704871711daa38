"""The service's routes (create_app): /search over a started Batcher, /health, /info, /stats,
/metrics, the search page at / (static/index.html of this package) and the OpenAPI docs at
/docs (Swagger UI served from DOCS_ASSETS, not a CDN: the docs work without internet)."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from dpjax import __version__
from dpjax.serve.auth import DOCS_ASSETS, limit_access
from dpjax.serve.batching import Batcher, RequestError
from dpjax.serve.parsing import Limits, parse_search, read_payload
from dpjax.serve.schema import (ERROR_RESPONSES, GET_QUERY, POST_BODY, Health, ManyAnswers,
                                OneAnswer, ServiceInfo, Stats)

log = logging.getLogger(__name__)
# The search page, served as written: HTML, CSS and script in one file, nothing filled in.
PAGE = (resources.files(__package__) / "static" / "index.html").read_text(encoding="utf-8")


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
  described = {"response_model": OneAnswer | ManyAnswers, "responses": ERROR_RESPONSES,
               "summary": "The top-k units of one or more questions"}
  app.get("/search", openapi_extra=GET_QUERY, operation_id="search_get", **described)(search)
  app.post("/search", openapi_extra=POST_BODY, operation_id="search_post", **described)(search)

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

  limit_access(app, metrics, key, loopback_hosts_only)
  return app


def _offline_docs_app() -> FastAPI:
  """A FastAPI app whose /docs page loads Swagger UI from the files fastapi-offline ships,
  mounted at DOCS_ASSETS, not from a CDN that a machine without internet never reaches (the page
  was blank there)."""
  return FastAPIOffline(title="dpjax", version=__version__, redoc_url=None,
                        static_url=DOCS_ASSETS,
                        description="Dense phrase retrieval: the top-k phrases, sentences, "
                                    "passages or documents of questions over an indexed corpus.")


def _search_route(batcher: Batcher, limits: Limits):
  """GET and POST /search: a request's questions searched in the next micro-batch, or refused
  with its status and one line; each counted by status in the metrics."""
  metrics = batcher.metrics

  async def search(request: Request) -> Response:
    questions: list[str] = []
    try:
      questions, single, k, unit = parse_search(await read_payload(request), limits)
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


def _error(status: int, reason: str) -> JSONResponse:
  return JSONResponse({"error": reason}, status_code=status)
