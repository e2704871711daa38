"""The API's shapes, as the OpenAPI schema at /openapi.json documents them: the pydantic models
of requests and answers, and the OpenAPI fragments of /search (its error answers, its POST body
with examples, its GET query parameters)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dpjax.index.units import UNITS

# parse_search (parsing.py), not pydantic, reads a request (its refusals name the field and the
# limit in one line), and answers are written as they are (FastAPI's encoder would walk every
# result in Python first); the tests check that the schema's examples are served and that
# answers fit these models.
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
  """A retrieved unit, as `PhraseSearcher.search` returns it."""
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
  reread: int = Field(0, description="top passages encoded again and scored exactly per "
                      "question (index.reread; 0: none)")
  reread_margin: float | None = Field(None, description="only passages holding a span within "
                                      "this score of the best re-read (index.reread_margin; "
                                      "null: all reread)")
  reread_window: int | None = Field(None, description="word pieces of a passage re-read around "
                                    "its best span (index.reread_window; null: the whole "
                                    "passage)")
  reread_scored_by: str | None = Field(None, description="the checkpoint whose question encoder "
                                       "scores re-read spans (index.reread_checkpoint; null: the "
                                       "one that ranks the candidates)")
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


# /search's OpenAPI fragments: its error answers, its POST body, its GET query parameters.
ERROR_RESPONSES = {status: {"model": ErrorAnswer, "description": text} for status, text in (
    (400, "a malformed request: the error names the field"),
    (413, "too many questions, a question or a body too long"),
    (415, "a body that is not application/json"),
    (500, "the search failed: the answer's request_id finds the cause in the server log"),
    (503, "the queue is full: try again"))}
_SEARCH_EXAMPLES = {"one": {"summary": "one question", "value": {
                        "question": "who founded the city?", "k": 3, "unit": "passage"}},
                    "many": {"summary": "several questions", "value": {
                        "questions": ["who founded the city?", "when was it built?"], "k": 5}}}
POST_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": SearchRequest.model_json_schema(), "examples": _SEARCH_EXAMPLES}}}}
GET_QUERY = {"parameters": [
    {"name": "q", "in": "query", "required": True, "style": "form", "explode": True,
     "description": "a question; repeat q for several (the answer then has `questions`)",
     "schema": {"type": "array", "items": {"type": "string"}},
     "example": ["who founded the city?"]},
    {"name": "k", "in": "query", "description": "results per question (1 to serve.max_k)",
     "schema": {"type": "integer", "minimum": 1, "default": 10}},
    {"name": "unit", "in": "query", "schema": {"type": "string", "enum": list(UNITS),
                                               "default": "phrase"}}]}
