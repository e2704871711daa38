"""Soak test of `run.py serve`: many requests from concurrent clients, a share of them bad, every
good answer checked against `PhraseSearcher.search`.

Before the server starts, the oracle: this process loads the workdir's searcher as the service
does (`load_searcher`) and searches every distinct question of the workdir's questions for each
(k, unit) of SEARCHES with `PhraseSearcher.search`. Then the server is started as serve_load.py
does, with an API key in its environment (`serve.api_key_env`, $DPJAX_API_KEY: the one set, else
a random one; never on a command line, in a log or in the report), and `--clients` threads send
`--requests` requests in all, each for a question and a (k, unit) of SEARCHES, `--bad-fraction`
of them bad, each kind with the status it must get:
  good        POST /search with the key                                        200
  malformed   a body that is not JSON                                          400
  empty       an empty question                                                400
  long        a question over serve.max_question_chars                         413
  declared    a Content-Length over the body limit (no body sent)              413
  unit        an unknown unit                                                  400
  k           k = 0                                                            400
  type        a text/plain body                                                415
  nokey       a good request without the key                                   401
  slow        a good request whose body arrives in pieces, with pauses         200
The answer of every good and slow request is compared with the oracle's (`first_difference`):
one that differs is wrong, and the report shows the first differences. Every `--window`
requests: the server's resident memory (/proc), the good requests' latency p50/p99 in the window,
and the statuses seen. The verdicts: no wrong answer, no unexpected status, resident memory
grown by less than 10% from the end of the first window (warm-up) to the last, the last window's
p99 within 1.5x of the first's.

  python experiments/benchmarks/serve_soak.py --config experiments/demo.py \\
      --workdir workdirs/demo --out results/serve_soak.json
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import pathlib
import random
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "benchmarks"))
from experiments.report import elide_notes, git_commit, save_results, with_notes  # noqa: E402
from serve_load import (authorization, run_clients, server_arguments, start_serving,  # noqa: E402
                        wait_healthy, workload)

BAD = {"malformed": 400, "empty": 400, "long": 413, "declared": 413, "unit": 400, "k": 400,
       "type": 415, "nokey": 401, "slow": 200}
# The (k, unit) searches the requests ask for: every unit, so each micro-batch mixes several
# searches (the service groups a batch's requests by (k, unit)).
SEARCHES = ((10, "phrase"), (5, "passage"), (3, "sentence"), (2, "document"))
# A served score agrees with the oracle's within this fraction of its size (at least 1): see
# first_difference.
SCORE_RTOL = 1e-5
WRONG_EXAMPLES = 20  # the wrong answers the report shows, the first ones


def oracle(config, workdir: str, questions: list[str]) -> dict[tuple, list[dict]]:
  """{(question, k, unit): the results `PhraseSearcher.search` finds} for each distinct question
  and each (k, unit) of SEARCHES, over the searcher loaded as `make_service` loads it (through
  JSON, as the service sends them)."""
  from dpjax.main import open_searcher
  searcher, _ = open_searcher(config, pathlib.Path(workdir), config.serve.index or None,
                              verify=config.index.verify)
  distinct = list(dict.fromkeys(questions))
  expected = {}
  for k, unit in SEARCHES:
    found = searcher.search(distinct, k=k, unit=unit,
                            max_answer_length=config.eval.max_answer_length)
    for question, results in zip(distinct, found):
      expected[(question, k, unit)] = json.loads(json.dumps(results))
  return expected


def first_difference(served, expected: list[dict], rtol: float = SCORE_RTOL) -> str | None:
  """How served results first differ from the oracle's (None: they agree).

  They agree when they are as many, in the same order, each with the same fields and every field
  equal (answer, passage text, id and row, title, start/end char, sentence, merged evidence) but
  the scores, each within `rtol` x max(1, |score|) of the oracle's. Scores are not compared
  exactly because they need not be bit-identical: the service encodes a question together with
  the others of its micro-batch (on a CPU several questions packed into one row of the encoder's
  call, on an accelerator a call of the batch's rows padded to its longest), the oracle with all
  the questions at once, and another call shape changes the order of the float32 sums in the
  encoder, hence the last bits of the question's vectors and of the scores (a few units in the
  last place). A real fault (another question's vectors, another passage's tokens, a stale
  index) moves a score by far more. Nothing else has a tolerance: two results whose scores are
  within rounding of each other and come in the other order are a difference, reported with
  their scores so that the report shows it is a near-tie.
  """
  if not isinstance(served, list):
    return f"results {str(served)[:80]!r}, not a list"
  if len(served) != len(expected):
    return f"{len(served)} results, expected {len(expected)}"
  for rank, (got, want) in enumerate(zip(served, expected)):
    if not isinstance(got, dict):
      return f"result {rank}: {str(got)[:80]!r}, not an object"
    for name in sorted(set(got) | set(want)):
      if name not in got or name not in want:
        return f"result {rank}: field {name} {'missing' if name in want else 'unexpected'}"
      a, b = got[name], want[name]
      if name == "score":
        equal = (isinstance(a, (int, float)) and not isinstance(a, bool)
                 and abs(a - b) <= rtol * max(1.0, abs(b)))
      elif name == "merged":
        inner = first_difference(a, b, rtol)
        if inner is not None:
          return f"result {rank}: merged {inner}"
        continue
      else:
        equal = a == b
      if not equal:
        return (f"result {rank}: {name} {_short(a)} != {_short(b)} (scores {got.get('score')!r} "
                f"and {want['score']!r})")
  return None


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def answer_difference(answer, search: tuple, expected: list[dict]) -> str | None:
  """How a 200's answer to `search` (question, k, unit) first differs from the oracle's results
  `expected`: the request it echoes, then its results (first_difference); None: it is right."""
  if not isinstance(answer, dict):
    return f"answer {_short(answer)}, not an object"
  echoed = (answer.get("question"), answer.get("k"), answer.get("unit"))
  if echoed != tuple(search):
    return f"answers {_short(echoed)} for {_short(tuple(search))}"
  return first_difference(answer.get("results"), expected)


class Answers:
  """The tally of the good answers checked against the oracle (thread-safe)."""

  def __init__(self, expected: dict[tuple, list[dict]]):
    self.expected, self._lock = expected, threading.Lock()
    self.right = self.identical = 0
    self.wrong: collections.Counter = collections.Counter()  # by (question, k, unit)
    self.examples: list[dict] = []
    self.largest_score_difference = 0.0  # over the right answers

  def check(self, answer, search: tuple) -> None:
    expected = self.expected[search]
    difference = answer_difference(answer, search, expected)
    with self._lock:
      if difference is None:
        self.right += 1
        self.identical += answer["results"] == expected
        self.largest_score_difference = max(
            [self.largest_score_difference] + [abs(a["score"] - b["score"])
                                               for a, b in zip(answer["results"], expected)])
        return
      self.wrong[search] += 1
      if len(self.examples) < WRONG_EXAMPLES:
        question, k, unit = search
        self.examples.append({"question": question, "k": k, "unit": unit,
                              "difference": difference})

  def summary(self) -> dict:
    return {"right": self.right, "wrong": sum(self.wrong.values()),
            "wrong_searches": len(self.wrong), "bit_identical": self.identical,
            "largest_score_difference": self.largest_score_difference, "score_rtol": SCORE_RTOL,
            "oracle_searches": len(self.expected), "wrong_examples": self.examples}


def request(port: int, kind: str, search: tuple, keep, max_chars: int, headers: dict):
  """Sends one request of `kind` for `search` (question, k, unit): a good one on `keep` (a new
  connection if None), the others on a fresh connection. Returns (status, the answer of a good
  or slow request that got a 200, else None, the connection to keep for the next good one)."""
  question, k, unit = search
  body = {"question": question, "k": k, "unit": unit}
  if kind == "good":
    connection = keep or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/search", json.dumps(body),
                       {"Content-Type": "application/json", **headers})
    response = connection.getresponse()
    answer = json.loads(response.read())
    return response.status, answer if response.status == 200 else None, connection
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  try:
    content, kind_header = json.dumps(body).encode(), "application/json"
    if kind == "malformed":
      content = b'{"question": "' + question.encode()
    elif kind == "empty":
      content = json.dumps({"question": ""}).encode()
    elif kind == "long":
      content = json.dumps({"question": "a" * (max_chars + 1)}).encode()
    elif kind == "unit":
      content = json.dumps({**body, "unit": "paragraph"}).encode()
    elif kind == "k":
      content = json.dumps({**body, "k": 0}).encode()
    elif kind == "type":
      kind_header = "text/plain"
    connection.putrequest("POST", "/search")
    connection.putheader("Content-Type", kind_header)
    for name, value in ({} if kind == "nokey" else headers).items():
      connection.putheader(name, value)
    length = (1 << 21) if kind == "declared" else len(content)
    connection.putheader("Content-Length", str(length))
    connection.endheaders()
    if kind == "slow":
      piece = max(len(content) // 3, 1)
      for start in range(0, len(content), piece):
        connection.send(content[start:start + piece])
        time.sleep(0.05)
    elif kind != "declared":
      connection.send(content)
    response = connection.getresponse()
    reply = response.read()
    answer = json.loads(reply) if kind == "slow" and response.status == 200 else None
    return response.status, answer, keep
  finally:
    connection.close()


def plan_requests(questions: list[str], args) -> list[tuple[str, tuple]]:
  """The soak's requests in order: (kind, (question, k, unit)), the same for the same arguments."""
  rng = random.Random(0)
  return [("good" if rng.random() >= args.bad_fraction else rng.choice(sorted(BAD)),
           (questions[i % len(questions)], *rng.choice(SEARCHES))) for i in range(args.requests)]


def soak(port: int, questions: list[str], args, pid: int, answers: Answers, key: str) -> dict:
  """Runs the soak (each good answer checked by `answers`); returns the windows, the statuses
  and the unexpected ones."""
  plan, headers = plan_requests(questions, args), authorization(key)
  lock, counter = threading.Lock(), iter(range(args.requests))
  done, windows, unexpected = [], [], collections.Counter()

  def close_window():
    """Called under the lock once every `window` requests (and at the end)."""
    closed = windows[-1]["requests"] if windows else 0
    rows = done[closed:]  # this window's requests only (the last may be shorter)
    good = np.array([ms for kind, _, ms in rows if kind == "good"])
    windows.append({"requests": len(done), "rss_mb": _rss_mb(pid),
                    "p50_ms": float(np.percentile(good, 50)) if len(good) else None,
                    "p99_ms": float(np.percentile(good, 99)) if len(good) else None,
                    "statuses": dict(collections.Counter(str(s) for _, s, _ in rows))})

  def client():
    keep = None
    while True:
      with lock:
        i = next(counter, None)
      if i is None:
        break
      kind, search = plan[i]
      start = time.perf_counter()
      try:
        status, answer, keep = request(port, kind, search, keep, args.max_question_chars,
                                       headers)
      except (OSError, http.client.HTTPException, ValueError) as e:
        status, answer, keep = type(e).__name__, None, None
      ms = 1e3 * (time.perf_counter() - start)
      if answer is not None:
        answers.check(answer, search)
      with lock:
        done.append((kind, status, ms))
        if status != BAD.get(kind, 200):
          unexpected[f"{kind}: {status}"] += 1
        if len(done) % args.window == 0:
          close_window()

  seconds = run_clients(client, args.clients)
  if len(done) % args.window:
    close_window()
  kinds = collections.Counter(kind for kind, _, _ in done)
  return {"seconds": seconds, "requests_per_s": len(done) / seconds, "windows": windows,
          "kinds": dict(kinds), "unexpected": dict(unexpected)}


def _rss_mb(pid: int) -> float:
  """The server's resident memory; NaN once it is gone (a server that died is in the report)."""
  try:
    lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
  except OSError:
    return float("nan")
  for line in lines:
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024
  return float("nan")


def verdicts(result: dict) -> dict:
  """The soak's verdicts; memory growth and p99 drift need two windows with good requests, the
  answers at least one checked (None: not measured, and then not ok)."""
  windows = result["windows"]
  growth = p99_ratio = None
  if len(windows) >= 2:
    warm, last = windows[0], windows[-1]
    growth = last["rss_mb"] / warm["rss_mb"] - 1
    if warm["p99_ms"] and last["p99_ms"]:
      p99_ratio = last["p99_ms"] / warm["p99_ms"]
  answers = result.get("answers", {})
  wrong = answers.get("wrong") if answers.get("right", 0) + answers.get("wrong", 0) else None
  measured = (growth is not None and growth == growth and p99_ratio is not None
              and wrong is not None)
  return {"wrong_answers": wrong, "unexpected_statuses": sum(result["unexpected"].values()),
          "rss_growth_after_warmup": growth, "p99_last_over_first": p99_ratio,
          "ok": (measured and wrong == 0 and not result["unexpected"] and growth < 0.10
                 and p99_ratio <= 1.5)}


def _number(value, scale: float = 1, spec: str = ".2f", unit: str = "") -> str:
  """A figure of the report, or "not measured"."""
  return "not measured" if value is None else f"{value * scale:{spec}}{unit}"


def render(r: dict, command: str) -> str:
  v, answers = r["verdicts"], r["answers"]
  checked = answers["right"] + answers["wrong"]
  lines = ["# Serving soak: `run.py serve` under mixed traffic", "",
           f"{r['requests']} requests from {r['clients']} clients, {r['bad_fraction']:.0%} "
           f"bad, in {r['seconds']:.0f} s ({r['requests_per_s']:.1f} requests/s), with an API "
           f"key from the environment; kinds: "
           + ", ".join(f"{k} {n}" for k, n in sorted(r["kinds"].items())) + f". Commit "
           f"{r['commit']}.", "",
           f"Each good and slow request's answer compared with `PhraseSearcher.search` of the "
           f"same question in the soak's process ({answers['oracle_searches']} searches: each "
           "question for each of " + ", ".join(f"k={k} {u}" for k, u in r["searches"])
           + f"): {answers['right']} of {checked} right, {answers['wrong']} wrong "
           f"({answers['wrong_searches']} searches); {answers['bit_identical']} bit-identical, "
           f"the others' scores within {answers['score_rtol']:g} x max(1, |score|) of the "
           f"oracle's (largest difference {answers['largest_score_difference']:.3g}).", "",
           "| verdict | value | wanted |", "|---|---|---|",
           f"| wrong answers | {_number(v['wrong_answers'], 1, 'd')} | 0 |",
           f"| unexpected statuses | {v['unexpected_statuses']} | 0 |",
           f"| resident memory growth after the first window | "
           f"{_number(v['rss_growth_after_warmup'], 100, '.1f', '%')} | < 10% |",
           f"| last window's p99 / first window's | {_number(v['p99_last_over_first'])} | "
           "<= 1.5 |",
           "", "| after request | server RSS MB | good p50 ms | good p99 ms | statuses |",
           "|---|---|---|---|---|"]
  lines += [f"| {w['requests']} | {_number(w['rss_mb'], 1, '.0f')} | "
            f"{_number(w['p50_ms'], 1, '.1f')} | {_number(w['p99_ms'], 1, '.1f')} | "
            + ", ".join(f"{s}: {n}" for s, n in sorted(w["statuses"].items())) + " |"
            for w in r["windows"]]
  if r["unexpected"]:
    lines += ["", "Unexpected: " + ", ".join(f"{k} x{n}" for k, n in r["unexpected"].items())]
  if answers["wrong_examples"]:
    lines += ["", "Wrong answers (the first ones, each with its first difference):", ""]
    lines += [f"- {e['question']!r} (k={e['k']}, {e['unit']}): {e['difference']}"
              for e in answers["wrong_examples"]]
  lines += ["", f"Server exit on SIGTERM: status {r['server_exit']}.", "", "Command:", "",
            "```bash", command, "```"]
  return with_notes(lines, r.get("notes", []))


def soak_key(config) -> tuple[str, str]:
  """(the environment variable the service reads its API key from, the key: the one set there,
  else a random one)."""
  name = config.serve.api_key_env
  if not name:
    raise SystemExit("the soak gives the server its API key through the environment: "
                     "serve.api_key_env must name a variable")
  return name, os.environ.get(name) or secrets.token_urlsafe(24)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  server_arguments(parser, requests=50_000, out="results/serve_soak.json")
  parser.add_argument("--bad-fraction", type=float, default=0.1)
  parser.add_argument("--window", type=int, default=1000)
  args = parser.parse_args(argv)
  commit = git_commit()
  config, questions, command = workload(args)
  args.max_question_chars = config.serve.max_question_chars
  start = time.perf_counter()
  answers = Answers(oracle(config, args.workdir, questions))
  oracle_seconds = time.perf_counter() - start
  name, key = soak_key(config)
  server, port = start_serving(command, env={**os.environ, name: key})
  try:
    wait_healthy(port, server)
    result = soak(port, questions, args, server.pid, answers, key)
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      exit_status = server.wait(timeout=60)
    except subprocess.TimeoutExpired:  # a server that does not stop: killed, and said so
      server.kill()
      server.wait()
      exit_status = "killed after 60 s"
  # The key was required: requests without it were sent, and every one was refused (401).
  auth = result["kinds"].get("nokey", 0) > 0 and not any(
      k.startswith("nokey:") for k in result["unexpected"])
  results = {**result, "commit": commit, "auth": auth, "requests": args.requests,
             "clients": args.clients, "bad_fraction": args.bad_fraction,
             "searches": [list(s) for s in SEARCHES], "answers": answers.summary(),
             "oracle_seconds": oracle_seconds, "server_exit": exit_status, "notes": args.note}
  results["verdicts"] = verdicts(results)
  save_results(args.out, results, render, "experiments/benchmarks/serve_soak.py",
               elide_notes(sys.argv[1:] if argv is None else argv))
  return results


if __name__ == "__main__":
  main()
