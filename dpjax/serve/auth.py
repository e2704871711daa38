"""Who the service answers: the API key (api_key) and the Bearer check on every route outside
OPEN_PATHS (BearerAuth), the refusal to listen beyond loopback without a key (check_exposure),
and, for a keyless service on loopback, the Host header guard against DNS rebinding
(LoopbackHostOnly); limit_access installs the guard a service needs on its app."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import socket

from fastapi import FastAPI
from starlette.responses import JSONResponse

from dpjax.errors import ConfigError
from dpjax.serve.metrics import ServiceMetrics

MIN_KEY_CHARS = 16  # an API key's least length: a short one is guessed by trying
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
  if key or allow_open or is_loopback(host):
    return
  raise ConfigError(f"serve.host {host!r} is reachable from other machines and no API key is "
                    "set: put one in the environment variable serve.api_key_env names "
                    "(DPJAX_API_KEY by default) or in serve.api_key, or --set "
                    "serve.allow_open=True to serve anyone on purpose")


def is_loopback(host: str) -> bool:
  """Whether every address `host` names is a loopback address (localhost, 127.0.0.1, ::1)."""
  try:
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    return all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)
  except (OSError, ValueError):  # not a name or an address of any machine
    return False


def limit_access(app: FastAPI, metrics: ServiceMetrics, key: str,
                  loopback_hosts_only: bool) -> None:
  """With a key, BearerAuth on every route outside OPEN_PATHS (and the schema says so); without
  one, `loopback_hosts_only`: LoopbackHostOnly on every route."""
  if key:
    app.add_middleware(BearerAuth, key=key, metrics=metrics)
    _document_auth(app)
  elif loopback_hosts_only:
    app.add_middleware(LoopbackHostOnly, metrics=metrics)


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
