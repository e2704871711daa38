"""`run.py serve`: the HTTP service on the tiny config, over 127.0.0.1."""
import dataclasses
import http.client
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, load_script
from dpjax.config import load_config
from dpjax.data.questions import read_questions
from dpjax.loading import data_paths
from dpjax.main import open_searcher
from dpjax.main.serve import service as serve_workdir
from dpjax.serve import start_server
from dpjax.settings import Settings

import run

CONFIG = "experiments/demo.py:tiny"
# The untrained tiny encoder (the service, not the model, is under test); micro-batches of up to
# 8 questions, so the warm-up compiles the packed question encoder (a CPU's) for calls of 8 rows
# (one a device) x 8 widths (8 to 64 tokens). No API key, whatever $DPJAX_API_KEY says.
SETTINGS = ["eval.allow_untrained=True", "serve.max_batch=8", "serve.api_key_env="]
load_test = load_script("experiments/benchmarks/serve_load.py")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
  """(port, config, workdir, questions, batcher) of a server over a trained tiny workdir."""
  workdir = tmp_path_factory.mktemp("serve")
  for mode in ("dump", "index"):
    assert run.main([mode, "--config", CONFIG, "--workdir", str(workdir),
                     *(f"--set={s}" for s in SETTINGS)]) == 0
  config = Settings.of(load_config(CONFIG, SETTINGS))
  questions = [q.question for q in read_questions(data_paths(config.data, config.index, workdir)["questions"])]
  app, batcher = serve_workdir(config, workdir)
  server, thread, port = start_server(app)
  yield port, config, workdir, questions, batcher
  server.should_exit = True
  thread.join()
  batcher.stop()


def request(port, method, path, body=None, content_type="application/json", headers=()):
  status, _, answer = raw_request(port, method, path, body, content_type, headers)
  return status, json.loads(answer or b"null")


def raw_request(port, method, path, body=None, content_type="application/json", headers=()):
  """(status, headers, body bytes) of one request on a connection of its own."""
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  sent = {"Content-Type": content_type} if body is not None else {}
  connection.request(method, path, body, {**sent, **dict(headers)})
  response = connection.getresponse()
  return response.status, dict(response.getheaders()), response.read()


def same(served, direct):
  assert len(served) == len(direct)
  for a, b in zip(served, direct):
    assert (a["answer"], a["passage_id"], a["start_char"], a["end_char"]) == (
        b["answer"], b["passage_id"], b["start_char"], b["end_char"])
    assert a["score"] == pytest.approx(b["score"], abs=1e-4)


def test_answers_equal_densephrases_search(service):
  port, config, workdir, questions, _ = service
  searcher, _ = open_searcher(config, workdir)
  for unit, k in (("phrase", 3), ("passage", 5), ("sentence", 2), ("document", 1)):
    direct = searcher.search(questions[:6], k=k, unit=unit,
                             max_answer_length=config.eval.max_answer_length)
    status, answer = request(port, "POST", "/search",
                             json.dumps({"questions": questions[:6], "k": k, "unit": unit}))
    assert status == 200 and answer["unit"] == unit and answer["k"] == k
    for served, expected in zip(answer["results"], direct):
      same(served, expected)
    status, one = request(port, "GET", f"/search?q={questions[0].replace(' ', '+')}"
                                       f"&k={k}&unit={unit}")
    assert status == 200 and one["question"] == questions[0]
    same(one["results"], direct[0])
    assert all(r["passage"][r["start_char"]:r["end_char"]] == r["answer"]
               for r in one["results"])


def test_hybrid_service_answers_as_hybrid_densephrases_search(service):
  """index.sparse served: each micro-batch's questions carry their texts to the BM25 half."""
  _, config, workdir, questions, _ = service
  hybrid = SETTINGS + ["index.sparse=True", "index.sparse_weight=2.0",
                       "index.sparse_sentence_weight=0.5"]
  assert run.main(["index", "--config", CONFIG, "--workdir", str(workdir), "--set=index.specs=[]",
                   *(f"--set={s}" for s in hybrid)]) == 0
  config = Settings.of(load_config(CONFIG, hybrid))
  dense, _ = open_searcher(Settings.of(load_config(CONFIG, SETTINGS)), workdir)
  searcher, _ = open_searcher(config, workdir)
  app, batcher = serve_workdir(config, workdir)
  server, thread, port = start_server(app)
  try:
    assert request(port, "GET", "/info")[1]["hybrid"] == {"weight": 2.0, "sentence_weight": 0.5,
                                                          "passages": 20}
    for unit, k in (("phrase", 3), ("passage", 5)):
      direct = searcher.search(questions[:6], k=k, unit=unit,
                               max_answer_length=config.eval.max_answer_length)
      status, answer = request(port, "POST", "/search",
                               json.dumps({"questions": questions[:6], "k": k, "unit": unit}))
      assert status == 200
      for served, expected in zip(answer["results"], direct):
        same(served, expected)
      assert direct != dense.search(questions[:6], k=k, unit=unit,
                                    max_answer_length=config.eval.max_answer_length)
    # One micro-batch of jobs with other (k, unit): each group's questions keep their texts.
    jobs = [_job(questions[:2], 3, "phrase"), _job(questions[2:5], 4, "passage"),
            _job(questions[5:7], 3, "phrase")]
    for job, served in zip(jobs, batcher.search(jobs)):
      expected = searcher.search(job.questions, k=job.k, unit=job.unit,
                                 max_answer_length=config.eval.max_answer_length)
      for a, b in zip(served, expected):
        same(a, b)
  finally:
    server.should_exit = True
    thread.join(10)
    batcher.stop(10)


@pytest.mark.parametrize("method,body,content_type,status,reason", [
    ("POST", "{}", "application/json", 400, "exactly one of question"),
    ("POST", '{"question": "  "}', "application/json", 400, "is empty"),
    ("POST", json.dumps({"question": "x" * 1001}), "application/json", 413, "characters"),
    ("POST", json.dumps({"questions": ["a?"] * 65}), "application/json", 413, "65 questions"),
    ("POST", '{"questions": []}', "application/json", 400, "0 questions"),
    ("POST", '{"question": "who?", "k": 0}', "application/json", 400, "k = 0"),
    ("POST", '{"question": "who?", "k": 101}', "application/json", 400, "k = 101"),
    ("POST", '{"question": "who?", "k": "ten"}', "application/json", 400, "integer"),
    ("POST", '{"question": "who?", "unit": "chapter"}', "application/json", 400, "unknown unit"),
    ("POST", '{"question": "who?", "top": 3}', "application/json", 400, "unknown field"),
    ("POST", '{"question": 7}', "application/json", 400, "string or a list"),
    ("POST", '{"question": "who?"', "application/json", 400, "malformed JSON"),
    ("POST", "[1, 2]", "application/json", 400, "JSON object"),
    ("POST", b"\xff\xfe", "application/json", 400, "malformed JSON"),
    ("POST", '{"question": "who \\ud800?"}', "application/json", 400, "not valid Unicode"),
    # no token at all (a zero-width space, NUL, a BOM): answered with results before
    ("POST", '{"question": "\\u200b"}', "application/json", 400, "question 0 is empty"),
    ("POST", '{"questions": ["who?", "\\u0000\\ufeff"]}', "application/json", 400,
     "question 1 is empty"),
    ("POST", "question=who", "application/x-www-form-urlencoded", 415, "content type"),
    ("GET", None, None, 400, "k = 0"),
    ("GET", None, None, 404, "Not Found"),
    ("DELETE", None, None, 405, "Method Not Allowed"),
])
def test_bad_requests_get_a_4xx_with_a_reason(service, method, body, content_type, status,
                                              reason):
  port = service[0]
  path = {404: "/nowhere", 405: "/search"}.get(status, "/search?q=who&k=0")
  got, answer = request(port, method, "/search" if method == "POST" else path, body,
                        content_type)
  assert got == status and reason in answer["error"] and "\n" not in answer["error"]
  assert request(port, "POST", "/search", '{"question": "who?"}')[0] == 200  # still serving


def test_health_stats_and_concurrent_clients_are_micro_batched(service, monkeypatch):
  """Concurrent clients' questions share encoder calls: with each call held 30 ms (a slower
  encoder), the requests that arrive meanwhile are encoded together in the next one."""
  port, _, _, questions, batcher = service
  status, health = request(port, "GET", "/health")
  assert status == 200 and health["status"] == "ok" and health["vectors"] > 0
  encode, calls = batcher.searcher.encode, []

  def slow_encode(asked, *args, **kwargs):
    calls.append(len(asked))
    time.sleep(0.03)
    return encode(asked, *args, **kwargs)

  monkeypatch.setattr(batcher.searcher, "encode", slow_encode)
  before = batcher.stats()
  result = load_test.measured(port, questions, 8, 200)
  assert result["errors"] == 0, result["error_examples"]
  # This phase's 200 questions in far fewer encoder calls than requests.
  assert sum(calls) == 200 and len(calls) == result["server_batches"] <= 100
  assert max(calls) >= 4 and result["mean_batch_questions"] >= 2
  assert result["server_batches"] * result["mean_batch_questions"] == pytest.approx(200)
  status, stats = request(port, "GET", "/stats")
  assert status == 200 and stats["requests"] - before.get("requests", 0) == 200
  assert stats["latency_p99_ms"] >= stats["latency_p50_ms"] > 0


def test_no_question_encoder_compile_while_serving(service):
  """The warm-up compiled every width and batch size the question encoder is called with."""
  from dpjax.parallel import compile_stats
  _, config, _, questions, batcher = service
  before = compile_stats()["count"]
  texts = questions + [" ".join(["what"] * n) for n in (1, 7, 15, 40)]  # 40: truncated to 24
  for size in range(1, config.serve.max_batch + 1):
    batcher.searcher.encode(texts[size:size * 2 - 1] + texts[-size:][:1])  # size questions
  rng = np.random.default_rng(0)
  for _ in range(30):  # any number of questions of any lengths
    batcher.searcher.encode([" ".join(["what"] * n) for n in rng.integers(
        1, 40, rng.integers(1, config.serve.max_batch + 1))])
  assert compile_stats()["count"] == before


def test_serve_command_answers_and_stops_on_sigint(service):
  """`run.py serve` on a free port of its own (serve.port=0, logged); a port in use is refused
  at once (exit 2, one line), before the index loads."""
  _, _, workdir, _, _ = service
  command = [sys.executable, "run.py", "serve", "--config", CONFIG, "--workdir", str(workdir),
             "--set", "eval.allow_untrained=True", "--set", "serve.max_batch=2",
             "--set", "serve.api_key_env="]
  server, port = load_test.start_serving(command + ["--set", "serve.port=0"], timeout=300)
  try:
    assert load_test.wait_healthy(port, server, timeout=300)["index"] == "Flat"
    assert request(port, "POST", "/search", '{"question": "who?", "k": 2}')[0] == 200
    taken = subprocess.run(command + ["--set", f"serve.port={port}"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
  finally:
    server.send_signal(signal.SIGINT)
    stopped = server.wait(timeout=60)
  assert stopped == 0
  assert taken.returncode == 2 and "Traceback" not in taken.stderr
  assert (f"serve.host '127.0.0.1', serve.port {port}: cannot listen there (Address already in "
          "use)") in taken.stderr
  assert "question encoder compiled" not in taken.stderr  # refused before loading the index


@pytest.mark.parametrize("host, port, cause", [
    ("127.0.0.1", 70000, r"bind\(\): port must be 0-65535"),
    ("192.0.2.1", 0, "Cannot assign requested address"),  # TEST-NET-1: not this machine's
])
def test_a_port_or_host_the_server_cannot_take_is_a_config_error(host, port, cause):
  from dpjax.errors import ConfigError
  from dpjax.serve import bind
  with pytest.raises(ConfigError, match=rf"serve.host '{host}', serve.port {port}: cannot listen "
                                        rf"there \({cause}"):
    bind(host, port)


def test_a_port_taken_while_the_index_loads_stays_the_servers():
  """The server's socket listens from the start: another server's bind of the same port (with
  SO_REUSEADDR, as uvicorn's and http.server's) is refused while the index still loads."""
  import socket
  from dpjax.serve import bind
  with bind("127.0.0.1", 0) as ours, socket.socket() as other:
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with pytest.raises(OSError, match="Address already in use"):
      other.bind(("127.0.0.1", ours.getsockname()[1]))


@pytest.mark.skipif(not shutil.which("chromium"), reason="needs Debian's chromium")
def test_web_page_shows_the_answer_highlighted(service, tmp_path):
  pytest.importorskip("playwright")
  port, _, _, questions, _ = service
  shown = load_test.screenshot(port, questions[0], tmp_path / "page.png", shutil.which("chromium"))
  assert shown["results"] == 5 and shown["first_mark"] == shown["first_answer"].split(". ", 1)[1]
  assert (tmp_path / "page.png").stat().st_size > 1000


def test_waiting_requests_form_one_micro_batch_up_to_max_batch(service):
  """Requests waiting when the search thread is free are searched as one batch (one encoder
  call) up to max_batch questions; one that would not fit starts the next batch. Each gets the
  answers of its questions searched alone."""
  from dpjax.serve import Batcher
  _, _, _, questions, served = service
  batcher = Batcher(served.searcher, max_batch=8)  # not started: the requests queue first
  asked = [questions[0:2], questions[2:3], questions[3:6], questions[6:9]]  # 2 + 1 + 3, then 3
  futures = [batcher.submit(q, 2, "phrase") for q in asked]
  batcher.start()
  try:
    results = [f.result(timeout=120) for f in futures]
  finally:
    batcher.stop()
  stats = batcher.stats()
  assert (stats["batches"], stats["requests"], stats["largest_batch"]) == (2, 4, 6)
  for question_list, result in zip(asked, results):
    alone = batcher.search([_job(question_list)])[0]
    for got, want in zip(result, alone):
      same(got, want)


def _job(questions, k=2, unit="phrase"):
  import concurrent.futures
  import time

  from dpjax.serve.batching import _Job
  return _Job(questions, k, unit, concurrent.futures.Future(), time.perf_counter())


def test_eval_progress_is_reported_and_changes_no_result(service, monkeypatch, caplog):
  _, config, workdir, questions, _ = service
  monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal (pytest -s in one): logs
  from dpjax.index import evaluate
  searcher, _ = open_searcher(config, workdir)
  q_start, q_end = searcher.encode(questions)
  top = searcher.search(questions, k=1)  # half the questions answered by their top phrase
  golds = [[found[0]["answer"]] if i % 2 else ["no such answer"] for i, found in enumerate(top)]
  whole = evaluate.retrieval_scores(searcher.index, q_start, q_end, golds, per_question=True)
  monkeypatch.setattr(evaluate, "PROGRESS_CHUNK", 5)
  with caplog.at_level("INFO", logger="dpjax.eval"):
    found = []
    chunked = evaluate.retrieval_scores(searcher.index, q_start, q_end, golds, per_question=True,
                                        progress=True, found=found)
  assert chunked == whole and len(found[0]) == len(questions)
  assert chunked["hits"]["em@1"] == "01" * (len(questions) // 2) + "0" * (len(questions) % 2)
  assert f"search: {len(questions)}/{len(questions)} questions in" in caplog.text  # non-TTY: logs


def test_texts_retrieved_pipelined_equal_their_vectors(service, monkeypatch):
  """`retrieve_texts` (`run.py eval`'s path) encodes the next chunk of questions while this one
  is searched, and finds what the same chunks' vectors find searched in turn; `found_scores`
  scores it as `retrieval_scores` does."""
  import threading

  _, config, workdir, questions, _ = service
  from dpjax.index import evaluate
  searcher, _ = open_searcher(config, workdir)
  chunks = [questions[lo:lo + 3] for lo in range(0, len(questions), 3)]
  assert len(chunks) >= 3
  vectors = [searcher.encode(chunk) for chunk in chunks]
  golds = [["no such answer"] for _ in questions]
  found = []
  want = evaluate.retrieval_scores(searcher.index, np.concatenate([v[0] for v in vectors]),
                                   np.concatenate([v[1] for v in vectors]), golds,
                                   shared_hits=True, found=found)
  next_began, searched = threading.Event(), []
  encode, retrieve = searcher.encode, evaluate.retrieve

  def encoding(texts):
    next_began.set() if texts == chunks[1] else None
    return encode(texts)

  def searching(*args, **kwargs):
    assert searched or next_began.wait(60)  # chunk 0 searched while chunk 1 is encoded
    searched.append(len(args[1]))
    return retrieve(*args, **kwargs)
  monkeypatch.setattr(evaluate, "retrieve", searching)
  got = evaluate.retrieve_texts(searcher.index, encoding, questions, evaluate.score_requests(),
                                chunk=3, shared_hits=True)
  assert searched == [len(chunk) for chunk in chunks]
  assert got == found
  assert evaluate.found_scores(searcher.index, got, golds) == want


def test_search_many_answers_each_request_as_its_own_search(service, monkeypatch):
  """`PhraseSearcher.search_many`: one index search a chunk of questions (2 here, pipelined) for
  several requests, each answered as its own search of the chunk answers it (an exact index;
  a question's vector depends on the questions encoded with it, by rounding)."""
  _, config, workdir, questions, _ = service
  from dpjax.index import evaluate
  searcher, _ = open_searcher(config, workdir)
  requests = [(3, "phrase"), (2, "passage"), (2, "document")]
  chunks = [questions[lo:lo + 2] for lo in range(0, len(questions), 2)]
  alone = [sum((searcher.search(chunk, k, unit) for chunk in chunks), [])
           for k, unit in requests]
  monkeypatch.setattr(evaluate, "PROGRESS_CHUNK", 2)
  searched, retrieve = [], evaluate.retrieve
  monkeypatch.setattr(evaluate, "retrieve", lambda *a, **k: searched.append(1) or retrieve(*a, **k))
  assert searcher.search_many(questions, requests) == alone
  assert len(searched) == (len(questions) + 1) // 2
  assert searcher.search_many([], requests) == [[], [], []]


def test_search_arguments_numpy_k_strings_and_empty_questions(service, tmp_path, caplog):
  """A numpy k passed `check_request` and then failed in faiss (a SWIG TypeError); a string
  given to search_many was searched letter by letter; chunk < 1 answered nothing;
  max_answer_length 0 failed in an argmax; a question without tokens ('', a zero-width space)
  was answered; eval over a file holding one crashed at its chunk."""
  _, config, workdir, questions, _ = service
  searcher, _ = open_searcher(config, workdir)
  assert searcher.search(questions[0], k=np.int64(3)) == searcher.search(questions[0], k=3)
  assert (searcher.search_many(questions[:2], [(np.int32(2), "passage")])
          == searcher.search_many(questions[:2], [(2, "passage")]))
  for call, message in (
      (lambda: searcher.search_many("who", [(3, "phrase")]), "not one string"),
      (lambda: searcher.search_many(questions[:2], [(3, "phrase")], chunk=-1), "chunk"),
      (lambda: searcher.search(questions[0], max_answer_length=0), "max_answer_length"),
      (lambda: searcher.search(""), r"question 0 \(''\) has no tokens"),
      (lambda: searcher.search(["who?", "\u200b"]), r"question 1 .* has no tokens")):
    with pytest.raises(ValueError, match=message):
      call()
  file = tmp_path / "questions.jsonl"
  file.write_text('{"id": "a", "question": "who?", "answers": ["x"]}\n'
                  '{"id": "b", "question": "\\ufeff", "answers": ["x"]}\n')
  code = run.main(["eval", "--config", CONFIG, "--workdir", str(workdir),
                   *(f"--set={s}" for s in SETTINGS), f"--set=index.questions={file}"])
  assert code == 2 and "questions.jsonl: 1 questions hold no token, e.g. b" in caplog.text


def test_regex_answers_and_passage_lists_shorter_than_20(service):
  """eval.regex: answers are patterns (CuratedTREC), EM matched at the prediction's start, no
  F1, passages searched; MRR and P@ are labelled by the depth they were taken at."""
  import re

  _, config, workdir, questions, _ = service
  from dpjax.index import evaluate
  searcher, _ = open_searcher(config, workdir)
  q_start, q_end = searcher.encode(questions)
  top = [found[0]["answer"] for found in searcher.search(questions, k=1)]
  plain = [[t] if i % 2 else ["no such answer"] for i, t in enumerate(top)]
  patterns = [[re.escape(t)] if i % 2 else ["no such answer"] for i, t in enumerate(top)]
  text = evaluate.retrieval_scores(searcher.index, q_start, q_end, plain, per_question=True)
  pattern = evaluate.retrieval_scores(searcher.index, q_start, q_end, patterns,
                                      per_question=True, regex=True)
  assert pattern["hits"]["em@1"] == text["hits"]["em@1"] and pattern["em@1"] == text["em@1"]
  assert "f1@1" in text and "f1@1" not in pattern
  # the top phrase's passage ranks first and holds the pattern's text
  assert pattern["top1"] == pytest.approx(100 * (len(questions) // 2) / len(questions))
  shallow = evaluate.retrieval_scores(searcher.index, q_start, q_end, plain, passage_k=5)
  assert {"top1", "top5", "mrr@5", "p@5"} <= set(shallow) and "p@20" not in shallow
  assert shallow["mrr@5"] <= text["mrr@20"]  # MRR@5 counts fewer ranks


@pytest.mark.parametrize("path,body,reason", [
    ("/search?q=who&k=%C2%B2", None, "integer"),  # "²": isdigit() but not int()'s
    ("/search?q=who&k=--3", None, "integer"),
    ("/search?q=who&k=" + "9" * 5000, None, "integer"),  # past int()'s 4,300 digits
    ("/search?q=who&k=1&k=2", None, "more than once"),
    ("/search?q=%FF", None, "not UTF-8"),  # was searched as U+FFFD
    ("/search?q=%ED%A0%80", None, "not UTF-8"),  # an encoded surrogate
    ("/search", "[" * 100000 + "]" * 100000, "malformed JSON"),  # RecursionError
    ("/search", '{"question": "who?", "k": ' + "9" * 5000 + "}", "malformed JSON"),
])
def test_odd_integers_and_bodies_get_a_400_not_a_500(service, path, body, reason):
  port = service[0]
  got, answer = request(port, "POST" if body else "GET", path, body)
  assert got == 400 and reason in answer["error"], answer
  assert request(port, "POST", "/search", '{"question": "who?"}')[0] == 200


def _open_post(port, header: str, value: str) -> http.client.HTTPConnection:
  """A POST /search of JSON whose headers (with `header`) are sent, the body not yet."""
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  connection.putrequest("POST", "/search")
  connection.putheader("Content-Type", "application/json")
  connection.putheader(header, value)
  connection.endheaders()
  return connection


def test_a_chunked_huge_body_is_refused_and_a_cancelled_request_stops_nothing(service):
  port, _, _, questions, batcher = service
  connection = _open_post(port, "Transfer-Encoding", "chunked")
  chunk = b"x" * (256 << 10)
  try:
    for _ in range(8):  # 2 MiB, no Content-Length; the server stops reading past 1 MiB
      connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    connection.send(b"0\r\n\r\n")
  except (BrokenPipeError, ConnectionResetError):
    pass  # refused before the rest was sent
  response = connection.getresponse()
  assert response.status == 413 and "limit" in json.loads(response.read())["error"]
  # A request cancelled while it waits (its client gone): the search thread carries on.
  cancelled = batcher.submit(questions[:1], 1, "phrase")
  cancelled.cancel()
  assert len(batcher.submit(questions[:1], 2, "phrase").result(timeout=60)[0]) == 2
  assert request(port, "POST", "/search", '{"question": "who?"}')[0] == 200


def test_a_declared_huge_body_is_refused_unread_and_a_failing_request_fails_alone(service):
  port, _, _, questions, batcher = service
  connection = _open_post(port, "Content-Length", str(1 << 30))  # no body: answered from it
  response = connection.getresponse()
  assert response.status == 413 and "limit" in json.loads(response.read())["error"]
  # A request whose search raises fails alone; others in its micro-batch are answered.
  search = batcher.search
  batcher.search = lambda batch: (search(batch) if all(j.questions != ["boom?"] for j in batch)
                                  else (_ for _ in ()).throw(RuntimeError("boom")))
  try:
    futures = [batcher.submit(q, 2, "phrase") for q in (["boom?"], questions[:1], questions[1:2])]
    assert isinstance(futures[0].exception(timeout=60), RuntimeError)
    assert all(len(f.result(timeout=60)[0]) == 2 for f in futures[1:])
  finally:
    batcher.search = search


def test_a_client_that_hangs_up_mid_body_is_no_failed_search(service):
  """A client that declared a body, sent part of it and left was counted as a failed search
  (`refused_500`, "search failed: ClientDisconnect")."""
  port, batcher = service[0], service[4]
  before = batcher.stats()
  with socket.create_connection(("127.0.0.1", port)) as client:
    client.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 100\r\n\r\n{\"question\": \"who\"")
  for _ in range(100):
    if batcher.stats().get("client_disconnects", 0) > before.get("client_disconnects", 0):
      break
    time.sleep(0.05)
  after = batcher.stats()
  assert after.get("client_disconnects", 0) == before.get("client_disconnects", 0) + 1
  assert after.get("refused_500", 0) == before.get("refused_500", 0)
  assert request(port, "POST", "/search", '{"question": "who?"}')[0] == 200


def test_library_loader_chatter_is_kept_out_unless_verbose(service):
  """faiss's loader logged "Could not load library with AVX2 support ... ModuleNotFoundError" at
  INFO on every run, which reads like a failure; `--verbose` brings it back. dpjax's lines stay."""
  _, _, workdir, _, _ = service
  command = [sys.executable, "run.py", "search", "--config", CONFIG, "--workdir", str(workdir),
             "--query", "who?", *(f"--set={s}" for s in SETTINGS)]
  quiet, verbose = (subprocess.run(command + flag, cwd=REPO, capture_output=True, text=True,
                                   timeout=300) for flag in ([], ["--verbose"]))
  assert quiet.returncode == verbose.returncode == 0, quiet.stderr[-2000:]
  assert "faiss.loader" not in quiet.stderr and "ModuleNotFoundError" not in quiet.stderr
  assert "faiss.loader: Successfully loaded faiss" in verbose.stderr
  assert "Q: who?" in quiet.stdout and "WARNING dpjax.loading" in quiet.stderr


# Every route the service has, with its methods (the docs' own, /openapi.json and /docs, aside).
ROUTES = {"/search": {"get", "post"}, "/health": {"get"}, "/info": {"get"}, "/stats": {"get"},
          "/metrics": {"get"}, "/": {"get"}}


def _validator(schema, name):
  """A JSON Schema validator of the OpenAPI schema's component `name` (refs resolved in it)."""
  import jsonschema
  return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                          "components": schema["components"]})


def test_openapi_schema_validates_lists_every_route_and_its_examples_are_served(service):
  """The schema and its docs page were switched off (`openapi_url=None`)."""
  import jsonschema
  from openapi_spec_validator import validate
  from dpjax.serve import Limits, create_app
  port, _, _, _, batcher = service
  status, schema = request(port, "GET", "/openapi.json")
  assert status == 200
  validate(schema)
  assert {path: set(operations) for path, operations in schema["paths"].items()} == ROUTES
  app = create_app(batcher, Limits(), request(port, "GET", "/info")[1])
  served = {(route.path, method.lower()) for route in app.routes
            for method in getattr(route, "methods", ()) if method != "HEAD"}
  served -= {("/openapi.json", "get"), ("/docs", "get"), ("/docs/oauth2-redirect", "get")}
  assert served == {(path, method) for path, methods in ROUTES.items() for method in methods}
  status, headers, page = raw_request(port, "GET", "/docs")
  assert status == 200 and b"swagger-ui" in page
  # The documented examples are served, and the answers are what the schema says.
  post = schema["paths"]["/search"]["post"]
  examples = post["requestBody"]["content"]["application/json"]["examples"]
  assert set(examples) == {"one", "many"}
  body_schema = jsonschema.Draft202012Validator(
      post["requestBody"]["content"]["application/json"]["schema"])
  for example in examples.values():
    body_schema.validate(example["value"])
    status, answer = request(port, "POST", "/search", json.dumps(example["value"]))
    assert status == 200
    _validator(schema, "OneAnswer" if "question" in example["value"] else "ManyAnswers"
               ).validate(answer)
  get = {p["name"]: p for p in schema["paths"]["/search"]["get"]["parameters"]}
  assert set(get) == {"q", "k", "unit"} and get["unit"]["schema"]["enum"] == [
      "phrase", "sentence", "passage", "document"]
  status, answer = request(port, "GET", "/search?q=who+founded+the+city%3F&unit=sentence")
  assert status == 200 and "sentence" in answer["results"][0]
  _validator(schema, "OneAnswer").validate(answer)
  for path, name in (("/health", "Health"), ("/info", "ServiceInfo"), ("/stats", "Stats")):
    _validator(schema, name).validate(request(port, "GET", path)[1])
  status, refused = request(port, "POST", "/search", '{"question": "who?", "k": 0}')
  assert status == 400 and "400" in post["responses"]
  _validator(schema, "ErrorAnswer").validate(refused)


def test_info_names_the_model_index_limits_and_version(service):
  import dpjax
  port, config, workdir, _, _ = service
  status, info = request(port, "GET", "/info")
  assert status == 200
  assert info == {**info, "model": config.model.name, "model_step": None, "index": "Flat",
                  "workdir": str(workdir), "units": ["phrase", "sentence", "passage", "document"],
                  "max_k": 100, "max_questions": 64, "max_question_chars": 1000,
                  "max_body_bytes": 1 << 20, "max_batch": 8, "version": dpjax.__version__,
                  "hybrid": None, "merge_spans": True, "reread": 0,
                  "reread_margin": None, "reread_window": None, "reread_scored_by": None}
  assert info["vectors"] > 0 and info["passages"] > 0
  status, health = request(port, "GET", "/health")
  assert health == {"status": "ok", "auth": False, "index": "Flat", "vectors": info["vectors"],
                    "passages": info["passages"], "model_step": None}


def _metrics(port, headers=()):
  from prometheus_client.parser import text_string_to_metric_families
  status, sent, body = raw_request(port, "GET", "/metrics", headers=headers)
  assert status == 200 and sent["content-type"].startswith("text/plain"), (status, body)
  return {family.name: family for family in text_string_to_metric_families(body.decode())}


def _sample(families, family, sample=None, **labels):
  return sum(s.value for s in families[family].samples
             if s.name == (sample or family) and all(s.labels.get(n) == v
                                                     for n, v in labels.items()))


def test_metrics_are_prometheus_text_and_stats_a_view_of_them(service):
  port, _, _, questions, _ = service
  before = _metrics(port)
  assert request(port, "POST", "/search", json.dumps({"questions": questions[:3]}))[0] == 200
  assert request(port, "POST", "/search", '{"question": "who?", "k": 0}')[0] == 400
  assert request(port, "POST", "/search", '{"questions": ["who?", "\\u200b"]}')[0] == 400
  assert request(port, "GET", "/nowhere")[0] == 404
  after = _metrics(port)
  assert {family.type for family in after.values()} == {"counter", "histogram", "gauge"}
  grew = {(family, sample, tuple(labels.items())): _sample(after, family, sample, **labels)
          - _sample(before, family, sample, **labels) for family, sample, labels in (
              ("dpjax_requests", "dpjax_requests_total", {"status": "200"}),
              ("dpjax_requests", "dpjax_requests_total", {"status": "400"}),
              ("dpjax_requests", "dpjax_requests_total", {"status": "404"}),
              ("dpjax_questions", "dpjax_questions_total", {"status": "200"}),
              ("dpjax_questions", "dpjax_questions_total", {"status": "400"}),
              ("dpjax_searched_requests", "dpjax_searched_requests_total", {}),
              ("dpjax_batch_questions", "dpjax_batch_questions_sum", {}),
              ("dpjax_request_latency_seconds", "dpjax_request_latency_seconds_count", {}))}
  # (a request refused before its questions were read counts none)
  assert list(grew.values()) == [1, 2, 1, 3, 2, 1, 3, 1]
  info = request(port, "GET", "/info")[1]
  assert _sample(after, "dpjax_index_vectors") == info["vectors"]
  assert _sample(after, "dpjax_index_passages") == info["passages"]
  assert _sample(after, "dpjax_queue_depth") == 0
  assert _sample(after, "dpjax_service_info", index="Flat",
                 version=info["version"]) == 1
  buckets = [s for s in after["dpjax_batch_questions"].samples if s.name.endswith("_bucket")]
  assert [s.labels["le"] for s in buckets] == ["1.0", "2.0", "4.0", "8.0", "+Inf"]  # max_batch 8
  # /stats: the same counters, read again (no request between the two reads)
  stats = request(port, "GET", "/stats")[1]
  again = _metrics(port)
  assert stats["requests"] == _sample(again, "dpjax_searched_requests",
                                      "dpjax_searched_requests_total")
  assert stats["batches"] == _sample(again, "dpjax_batch_questions", "dpjax_batch_questions_count")
  assert stats["questions"] == _sample(again, "dpjax_batch_questions", "dpjax_batch_questions_sum")
  assert stats["refused_404"] == _sample(again, "dpjax_requests", "dpjax_requests_total",
                                         status="404")


def test_latency_quantiles_are_interpolated_within_their_bucket():
  from prometheus_client import CollectorRegistry, Histogram
  from dpjax.serve import quantile
  histogram = Histogram("h", "h", buckets=(1, 2, 4), registry=CollectorRegistry())
  assert quantile(histogram, 0.5) is None
  for value in (0.5, 1.5, 1.5, 3):  # 1 in (0, 1], 2 in (1, 2], 1 in (2, 4]
    histogram.observe(value)
  assert quantile(histogram, 0.25) == 1.0 and quantile(histogram, 0.5) == 1.5
  assert quantile(histogram, 1.0) == 4.0
  histogram.observe(100)  # past the last bound: the last bound is the estimate
  assert quantile(histogram, 1.0) == 4.0


KEY = "s3cret-key_0123456789"


def test_an_api_key_guards_every_route_but_health_and_the_pages(service, monkeypatch):
  """401 without the key or with a wrong one (one line, counted in /metrics), 200 with it; the
  keys are compared by hmac.compare_digest."""
  import hmac

  from dpjax import serve
  from dpjax.serve import auth
  port, _, _, questions, batcher = service
  compared, compare = [], hmac.compare_digest
  monkeypatch.setattr(auth.hmac, "compare_digest",  # the module BearerAuth compares keys with
                      lambda a, b: compared.append(1) or compare(a, b))
  app = serve.create_app(batcher, serve.Limits(), request(port, "GET", "/info")[1], KEY)
  server, thread, guarded = start_server(app)
  good = {"Authorization": f"Bearer {KEY}"}
  try:
    before = _metrics(guarded, good)
    refused = 0
    for method, path, body, status in (("GET", "/search?q=who", None, 200),
                                       ("POST", "/search", '{"question": "who?"}', 200),
                                       ("GET", "/info", None, 200), ("GET", "/stats", None, 200),
                                       ("GET", "/metrics", None, 200),
                                       ("GET", "/nowhere", None, 404)):
      for headers, reason in (({}, "needs its API key"),
                              ({"Authorization": "Bearer wrong"}, "wrong API key"),
                              ({"Authorization": f"Bearer {KEY}x"}, "wrong API key"),
                              ({"Authorization": KEY}, "Authorization: Bearer <key>")):
        got, sent, answer = raw_request(guarded, method, path, body, headers=headers)
        assert got == 401 and sent["www-authenticate"] == "Bearer", (path, headers)
        assert reason in json.loads(answer)["error"] and b"\n" not in answer
        refused += 1
      assert raw_request(guarded, method, path, body, headers=good)[0] == status, path
    assert len(compared) == 2 * 6 + 6 + 1  # each wrong key and each good one, and the scrape
    # the load benchmark's clients with the key (experiments/benchmarks/serve_load.py --auth)
    assert load_test.measured(guarded, questions, 4, 20, key=KEY)["errors"] == 0
    after = _metrics(guarded, good)
    assert (_sample(after, "dpjax_requests", "dpjax_requests_total", status="401")
            - _sample(before, "dpjax_requests", "dpjax_requests_total", status="401")) == refused
    for path in ("/health", "/", "/docs", "/openapi.json", *DOCS_ASSETS):  # no data, or a page
      assert raw_request(guarded, "GET", path)[0] == 200, path
    assert request(guarded, "GET", "/health")[1]["auth"] is True
    schema = request(guarded, "GET", "/openapi.json")[1]
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                                  "scheme": "bearer"}}
    assert schema["paths"]["/info"]["get"]["security"] == [{"bearer": []}]
    assert "401" in schema["paths"]["/search"]["post"]["responses"]
    assert "security" not in schema["paths"]["/health"]["get"]
  finally:
    server.should_exit = True
    thread.join()


def test_the_api_key_comes_from_the_config_or_the_environment(monkeypatch):
  from dpjax.errors import ConfigError
  from dpjax.serve import api_key
  serve = Settings.of(load_config(CONFIG)).serve
  monkeypatch.delenv("DPJAX_API_KEY", raising=False)
  assert api_key(serve) == ""
  monkeypatch.setenv("DPJAX_API_KEY", KEY)
  assert api_key(serve) == KEY
  serve = dataclasses.replace(serve, api_key=KEY)
  assert api_key(serve) == KEY  # the same key twice
  for key, env, message in (("other", KEY, r"serve.api_key and \$DPJAX_API_KEY are both set and "
                                           "differ"),
                            ("two words", "", r"API key \(serve.api_key\) must be printable"),
                            ("", "tab\tkey", r"API key \(\$DPJAX_API_KEY\) must be printable"),
                            ("s3cret-key", "", r"^the API key \(serve.api_key\) has 10 "
                                               r"characters; give at least 16, e.g. python"),
                            ("", KEY[:15], r"^the API key \(\$DPJAX_API_KEY\) has 15 characters")):
    serve = dataclasses.replace(serve, api_key=key)
    monkeypatch.setenv("DPJAX_API_KEY", env)
    with pytest.raises(ConfigError, match=message):
      api_key(serve)


@pytest.mark.parametrize("host, key, allow_open, refused", [
    ("0.0.0.0", "", False, True), ("::", "", False, True), ("192.0.2.1", "", False, True),
    ("127.0.0.1", "", False, False), ("localhost", "", False, False), ("::1", "", False, False),
    ("0.0.0.0", KEY, False, False), ("0.0.0.0", "", True, False)])
def test_an_open_address_needs_a_key_or_allow_open(host, key, allow_open, refused):
  from dpjax.errors import ConfigError
  from dpjax.serve import check_exposure
  if refused:
    with pytest.raises(ConfigError, match=rf"serve.host '{re.escape(host)}' is reachable from "
                                          "other machines and no API key is set"):
      check_exposure(host, key, allow_open)
  else:
    check_exposure(host, key, allow_open)


def test_with_an_api_key_the_host_header_is_not_checked(service):
  """A keyed service may be reached by any name (a proxy's, a LAN name): the key guards it."""
  from dpjax import serve
  port, _, _, _, batcher = service
  app = serve.create_app(batcher, serve.Limits(), request(port, "GET", "/info")[1], KEY,
                         loopback_hosts_only=True)
  server, thread, guarded = start_server(app)
  try:
    foreign = {"Host": "search.example:8000"}
    assert raw_request(guarded, "GET", "/info", headers={
        **foreign, "Authorization": f"Bearer {KEY}"})[0] == 200
    assert raw_request(guarded, "GET", "/info", headers=foreign)[0] == 401
  finally:
    server.should_exit = True
    thread.join()


@pytest.mark.parametrize("host, status", [
    ("127.0.0.1", 200), ("localhost", 200), ("LocalHost:8000", 200), ("[::1]:8000", 200),
    ("127.0.0.2:1", 200), ("rebound.example", 403), ("rebound.example:8000", 403),
    ("localhost.rebound.example", 403), ("127.0.0.1.rebound.example", 403),
    ("[::1].rebound.example", 403), ("10.0.0.1:8000", 403)])
def test_a_keyless_loopback_service_answers_only_loopback_host_names(service, host, status):
  """DNS rebinding: a page of another site names the service by a host of its own that it then
  points at 127.0.0.1; the Host header it sends is that name, refused on every route."""
  port, _, _, _, batcher = service
  before = batcher.stats().get("refused_403", 0)
  for path in ("/health", "/search?q=who", "/docs"):
    got, _, answer = raw_request(port, "GET", path, headers={"Host": host})
    assert got == status, (host, path)
    if status == 403:
      error = json.loads(answer)["error"]
      assert f"Host {host!r} is not a loopback name" in error and "\n" not in error
  assert batcher.stats().get("refused_403", 0) - before == (3 if status == 403 else 0)


# The files the docs page loads, all from the service itself (fastapi-offline's Swagger UI).
DOCS_ASSETS = ("/docs/assets/swagger-ui.css", "/docs/assets/favicon.png",
               "/docs/assets/swagger-ui-bundle.js")


def test_the_docs_page_loads_only_files_of_the_service(service):
  """/docs loaded Swagger UI from a CDN: a blank page on a machine without internet."""
  port = service[0]
  status, _, page = raw_request(port, "GET", "/docs")
  assert status == 200 and not re.findall(rb"(?i)https?:|//[a-z]", page)  # no other origin
  assert re.findall(rb'(?:src|href)="([^"]*)"', page) == [a.encode() for a in DOCS_ASSETS]
  for path, kind in zip(DOCS_ASSETS, ("text/css", "image/png", "javascript")):
    status, headers, body = raw_request(port, "GET", path)
    assert status == 200 and kind in headers["content-type"] and body, path
  assert b".swagger-ui" in raw_request(port, "GET", DOCS_ASSETS[0])[2]
  assert b"SwaggerUIBundle" in raw_request(port, "GET", DOCS_ASSETS[-1])[2]


CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt install chromium)")
def test_the_docs_page_renders_the_operations_in_chromium_offline(service, tmp_path):
  """Headless chromium, every name but 127.0.0.1 unresolvable and any other address sent to a
  dead proxy, renders the docs of /search (the CDN page rendered none)."""
  port = service[0]
  shown = subprocess.run(
      [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
       "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
       "--proxy-server=http://127.0.0.1:9", "--virtual-time-budget=30000", "--dump-dom",
       f"http://127.0.0.1:{port}/docs"], capture_output=True, text=True, timeout=120)
  assert shown.returncode == 0, shown.stderr[-2000:]
  assert 'data-path="/search"' in shown.stdout and 'data-path="/health"' in shown.stdout


def test_a_failed_search_answers_a_request_id_and_logs_the_cause(service, monkeypatch, caplog):
  """The 500's body carried the exception's text (paths, internals) to the client."""
  port, _, _, _, batcher = service

  def failing(batch):
    raise RuntimeError("index shard /data/secret.faiss unreadable")

  monkeypatch.setattr(batcher, "search", failing)
  with caplog.at_level("ERROR", logger="dpjax.serve"):
    status, answer = request(port, "POST", "/search", '{"question": "who?"}')
  monkeypatch.undo()
  assert status == 500 and set(answer) == {"error", "request_id"}
  request_id = answer["request_id"]
  assert re.fullmatch("[0-9a-f]{16}", request_id) and "secret" not in json.dumps(answer)
  assert answer["error"] == (f"the search failed (request id {request_id}); the server log has "
                             "the cause")
  logged = [r for r in caplog.records if request_id in r.getMessage()]
  assert len(logged) == 1 and logged[0].exc_info is not None
  assert "RuntimeError: index shard /data/secret.faiss unreadable" in logged[0].getMessage()
  assert request(port, "POST", "/search", '{"question": "who?"}')[0] == 200


def test_serve_refuses_an_open_address_without_a_key_before_loading(monkeypatch, caplog,
                                                                    tmp_path):
  monkeypatch.delenv("DPJAX_API_KEY", raising=False)
  code = run.main(["serve", "--config", CONFIG, "--workdir", str(tmp_path),
                   "--set", "serve.host=0.0.0.0", "--set", "serve.port=0"])
  assert code == 2
  assert "serve.host '0.0.0.0' is reachable from other machines" in caplog.text
  assert "allow_open=True" in caplog.text and "question encoder compiled" not in caplog.text


def test_sigterm_answers_the_requests_in_flight_and_exits_0(service):
  """SIGTERM with requests queued (the search thread waits serve.max_wait_ms for a fuller
  micro-batch): the server stops accepting at once, answers every one of them, and exits 0
  (uvicorn re-raised the SIGTERM once stopped, which killed the process: status -15)."""
  import concurrent.futures
  import threading

  _, _, workdir, questions, _ = service
  command = [sys.executable, "run.py", "serve", "--config", CONFIG, "--workdir", str(workdir),
             *(f"--set={s}" for s in SETTINGS), "--set", "serve.port=0",
             "--set", "serve.max_wait_ms=4000", "--set", "serve.shutdown_timeout_s=60"]
  server, port = load_test.start_serving(command, timeout=300)
  try:
    load_test.wait_healthy(port, server, timeout=300)
    sent = threading.Barrier(7)

    def ask(question):
      connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
      connection.request("POST", "/search", json.dumps({"question": question, "k": 2}),
                         {"Content-Type": "application/json"})
      sent.wait(30)
      response = connection.getresponse()
      return response.status, json.loads(response.read())

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      answers = [pool.submit(ask, question) for question in questions[:6]]
      sent.wait(30)
      time.sleep(0.5)  # read by the server: queued behind the batch waiting for more
      stopping = time.perf_counter()
      server.send_signal(signal.SIGTERM)
      time.sleep(1.0)
      with pytest.raises(ConnectionRefusedError):  # no longer accepting
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
      results = [answer.result(timeout=120) for answer in answers]
    stopped = server.wait(timeout=60)
  finally:
    if server.poll() is None:
      server.kill()
  assert stopped == 0
  assert [status for status, _ in results] == [200] * 6
  assert [len(answer["results"]) for _, answer in results] == [2] * 6
  assert time.perf_counter() - stopping < 60


def test_sigterm_waits_at_most_shutdown_timeout_s_for_requests(service):
  """A request the server would hold for long (the search thread waits 60 s for a fuller batch)
  is given serve.shutdown_timeout_s after SIGTERM, then the server exits 0 all the same. (No
  --config: the workdir's own, saved by the dump that made it, with SETTINGS.)"""
  _, _, workdir, _, _ = service
  command = [sys.executable, "run.py", "serve", "--workdir", str(workdir), "--set", "serve.port=0",
             "--set", "serve.max_wait_ms=60000", "--set", "serve.shutdown_timeout_s=2"]
  server, port = load_test.start_serving(command, timeout=300)
  try:
    load_test.wait_healthy(port, server, timeout=300)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/search", '{"question": "who?"}',
                       {"Content-Type": "application/json"})
    time.sleep(0.5)  # read by the server, held by the search thread
    stopping = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    stopped = server.wait(timeout=60)
    waited = time.perf_counter() - stopping
  finally:
    if server.poll() is None:
      server.kill()
  assert stopped == 0 and waited < 20
