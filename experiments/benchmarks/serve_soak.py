"""Soak test of `run.py serve`: many requests from concurrent clients, a share of them bad.

Starts the server as serve_load.py does, then `--clients` threads send `--requests` requests in
all, `--bad-fraction` of them bad, each kind with the status it must get:
  good        POST /search, one question of the workdir's questions            200
  malformed   a body that is not JSON                                          400
  empty       an empty question                                                400
  long        a question over serve.max_question_chars                         413
  declared    a Content-Length over the body limit (no body sent)              413
  unit        an unknown unit                                                  400
  k           k = 0                                                            400
  type        a text/plain body                                                415
  slow        a good request whose body arrives in pieces, with pauses         200
Every `--window` requests: the server's resident memory (/proc), the good requests' latency
p50/p99 in the window, and the statuses seen. The verdicts: no unexpected status, resident
memory grown by less than 10% from the end of the first window (warm-up) to the last, the last
window's p99 within 1.5x of the first's.

  python experiments/benchmarks/serve_soak.py --config experiments/demo.py \\
      --workdir workdirs/demo --out results/serve_soak.json
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import pathlib
import random
import signal
import sys
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "benchmarks"))
from experiments.report import elide_notes, save_results, with_notes  # noqa: E402
from serve_load import (run_clients, server_arguments, start_serving, wait_healthy,  # noqa: E402
                        workload)

BAD = {"malformed": 400, "empty": 400, "long": 413, "declared": 413, "unit": 400, "k": 400,
       "type": 415, "slow": 200}


def request(port: int, kind: str, question: str, keep, max_chars: int, headers: dict):
  """Sends one request of `kind` (a fresh connection for bad kinds, `keep` for good ones);
  returns (status, the connection to keep for the next good request)."""
  body = {"question": question, "k": 10}
  if kind == "good":
    connection = keep or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/search", json.dumps(body),
                       {"Content-Type": "application/json", **headers})
    response = connection.getresponse()
    answer = json.loads(response.read())
    if response.status == 200 and not answer.get("results"):
      return "200 without results", connection
    return response.status, connection
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
    for name, value in headers.items():
      connection.putheader(name, value)
    length = (1 << 21) if kind == "declared" else len(content)
    connection.putheader("Content-Length", str(length))
    connection.endheaders()
    if kind == "slow":
      for start in range(0, len(content), max(len(content) // 3, 1)):
        connection.send(content[start:start + max(len(content) // 3, 1)])
        time.sleep(0.05)
    elif kind != "declared":
      connection.send(content)
    response = connection.getresponse()
    response.read()
    return response.status, keep
  finally:
    connection.close()


def soak(port: int, questions: list[str], args, pid: int) -> dict:
  """Runs the soak; returns the windows, the statuses and the unexpected ones."""
  rng = random.Random(0)
  plan = [("good" if rng.random() >= args.bad_fraction else rng.choice(sorted(BAD)),
           questions[i % len(questions)]) for i in range(args.requests)]
  headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
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
      kind, question = plan[i]
      start = time.perf_counter()
      try:
        status, keep = request(port, kind, question, keep, args.max_question_chars, headers)
      except (OSError, http.client.HTTPException, ValueError) as e:
        status, keep = type(e).__name__, None
      ms = 1e3 * (time.perf_counter() - start)
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
  """The soak's verdicts; memory growth and p99 drift need two windows with good requests
  (None: not measured, and then not ok)."""
  windows = result["windows"]
  growth = p99_ratio = None
  if len(windows) >= 2:
    warm, last = windows[0], windows[-1]
    growth = last["rss_mb"] / warm["rss_mb"] - 1
    if warm["p99_ms"] and last["p99_ms"]:
      p99_ratio = last["p99_ms"] / warm["p99_ms"]
  measured = growth is not None and growth == growth and p99_ratio is not None
  return {"unexpected_statuses": sum(result["unexpected"].values()),
          "rss_growth_after_warmup": growth, "p99_last_over_first": p99_ratio,
          "ok": measured and not result["unexpected"] and growth < 0.10 and p99_ratio <= 1.5}


def _number(value, scale: float = 1, spec: str = ".2f", unit: str = "") -> str:
  """A figure of the report, or "not measured"."""
  return "not measured" if value is None else f"{value * scale:{spec}}{unit}"


def render(r: dict, command: str) -> str:
  v = r["verdicts"]
  lines = ["# Serving soak: `run.py serve` under mixed traffic", "",
           f"{r['requests']} requests from {r['clients']} clients, {r['bad_fraction']:.0%} "
           f"bad, in {r['seconds']:.0f} s ({r['requests_per_s']:.1f} requests/s); kinds: "
           + ", ".join(f"{k} {n}" for k, n in sorted(r["kinds"].items())) + ".", "",
           "| verdict | value | wanted |", "|---|---|---|",
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
  lines += ["", f"Server exit on SIGTERM: status {r['server_exit']}.", "", "Command:", "",
            "```bash", command, "```"]
  return with_notes(lines, r.get("notes", []))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  server_arguments(parser, requests=50_000, out="results/serve_soak.json")
  parser.add_argument("--bad-fraction", type=float, default=0.1)
  parser.add_argument("--window", type=int, default=1000)
  parser.add_argument("--api-key", default="", help="sent as a bearer token when given")
  args = parser.parse_args(argv)
  config, questions, command = workload(args)
  args.max_question_chars = config.serve.max_question_chars
  server, port = start_serving(command)
  try:
    wait_healthy(port, server)
    result = soak(port, questions, args, server.pid)
  finally:
    server.send_signal(signal.SIGTERM)
    exit_status = server.wait(timeout=60)
  results = {**result, "requests": args.requests, "clients": args.clients,
             "bad_fraction": args.bad_fraction, "server_exit": exit_status, "notes": args.note}
  results["verdicts"] = verdicts(result)
  save_results(args.out, results, render, "experiments/benchmarks/serve_soak.py",
               elide_notes(sys.argv[1:] if argv is None else argv))
  return results


if __name__ == "__main__":
  main()
