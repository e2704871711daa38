"""`run.py serve`: an HTTP search service (FastAPI + uvicorn) over a workdir's index.

- `GET /search?q=...&k=10&unit=passage` (q repeatable) and `POST /search` with JSON
  `{"question": "..."}` or `{"questions": [...]}` plus optional `k` and `unit`: the top-k units
  (phrase, sentence, passage, document), each with its answer phrase, score, passage id, row and
  title, the passage text and the answer's character span in it (as `PhraseSearcher.search`).
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

The modules, each importing only those above it: `metrics` (ServiceMetrics, the counters),
`batching` (Batcher, RequestError), `parsing` (a request's fields and limits), `schema` (the
OpenAPI models), `auth` (the API key and the Host guard), `app` (create_app: the routes and the
page, `static/index.html`), `service` (make_service, bind, start_server). Their public
names are importable from `dpjax.serve` too.
"""
from dpjax.errors import ConfigError

# The import names of the `serve` extra's packages (and starlette, fastapi's own): an
# ImportError of one of them means the extra is missing or too old, not a broken dpjax.
_EXTRA = frozenset({"fastapi", "fastapi_offline", "prometheus_client", "pydantic", "starlette",
                    "uvicorn"})

try:  # the service's own dependencies are an extra of the install
  from dpjax.serve.app import PAGE, create_app
  from dpjax.serve.auth import (DOCS_ASSETS, MIN_KEY_CHARS, OPEN_PATHS, BearerAuth,
                                LoopbackHostOnly, api_key, check_exposure)
  from dpjax.serve.batching import Batcher, RequestError
  from dpjax.serve.metrics import LATENCY_BUCKETS, ServiceMetrics, quantile
  from dpjax.serve.parsing import MAX_BODY, Limits, parse_search
  from dpjax.serve.schema import (EXAMPLE_RESULT, ErrorAnswer, Evidence, Health, ManyAnswers,
                                  OneAnswer, Result, SearchRequest, ServiceInfo, Stats, Unit)
  from dpjax.serve.service import bind, make_service, start_server
except ImportError as e:  # missing, or a version without what is imported (pydantic 1)
  if (e.name or "").partition(".")[0] not in _EXTRA:
    raise
  raise ConfigError(f"the service cannot import {e.name} ({e}): "
                    "pip install 'dpjax[serve]'") from None

__all__ = ["DOCS_ASSETS", "EXAMPLE_RESULT", "LATENCY_BUCKETS", "MAX_BODY", "MIN_KEY_CHARS",
           "OPEN_PATHS", "PAGE", "Batcher", "BearerAuth", "ErrorAnswer", "Evidence", "Health",
           "Limits", "LoopbackHostOnly", "ManyAnswers", "OneAnswer", "RequestError", "Result",
           "SearchRequest", "ServiceInfo", "ServiceMetrics", "Stats", "Unit", "api_key", "bind",
           "check_exposure", "create_app", "make_service", "parse_search", "quantile",
           "start_server"]
