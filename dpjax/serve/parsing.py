"""What a search request asks: its fields read from a GET query string or a POST JSON body
(read_payload) and checked against the service's limits (parse_search), or a RequestError with
the status and one line saying why."""
from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse

from starlette.requests import Request

from dpjax.index.units import UNITS
from dpjax.serve.batching import RequestError

MAX_BODY = 1 << 20  # bytes of a POST body


@dataclasses.dataclass
class Limits:
  """What one request may ask: the largest k, the questions per request, the characters per
  question (`serve.max_k`, `serve.max_questions`, `serve.max_question_chars`)."""
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


async def read_payload(request: Request) -> dict:
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
