"""Load test of `run.py serve`: one client, then many concurrent clients, over loopback.

Starts `python run.py serve` on a free port (`serve.port=0`) as its own process (the clients'
threads do not share its interpreter), waits for /health, then sends the workdir's evaluation
questions as single-question POST /search requests: `--single` of them from one client, one after the
other, then `--requests` from `--clients` concurrent clients (each a keep-alive connection).
Reports questions/s, client-side latency p50/p99 and errors of both, the concurrency gain (the
micro-batching), the server's /stats, and with `--screenshot` the web page after a search in
headless chromium (playwright). The server is stopped with SIGINT and must exit cleanly.
With `--auth` the server requires an API key (a random one, passed in $DPJAX_API_KEY) and every
client request and the page send it.

  python experiments/benchmarks/serve_load.py --config experiments/demo.py \
      --workdir workdirs/demo --out results/serve.json --screenshot results/serve_page.png
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.report import elide_notes, save_results, with_notes  # noqa: E402


def start_serving(command: list[str], timeout: float = 600,
                  env: dict | None = None) -> tuple[subprocess.Popen, int]:
  """Starts `command` (`run.py serve ... --set serve.port=0`: the server takes a free port
  itself, so no other process can take it first) with `env`; returns (process, port) once its
  log names the port. Its log goes on to this stderr."""
  server = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
  ports: queue.Queue = queue.Queue()

  def relay():
    for line in server.stderr:
      sys.stderr.write(line)
      if match := re.search(r"serving .* on http://\S+:(\d+)/", line):
        ports.put(int(match.group(1)))
    ports.put(None)

  threading.Thread(target=relay, daemon=True).start()
  try:
    port = ports.get(timeout=timeout)
  except queue.Empty:
    server.kill()
    raise SystemExit(f"the server named no port within {timeout:.0f} s") from None
  if port is None:
    raise SystemExit(f"the server exited with status {server.wait()} before serving")
  return server, port


def authorization(key: str) -> dict:
  """The header that carries an API key ('' : none)."""
  return {"Authorization": f"Bearer {key}"} if key else {}


def post(connection: http.client.HTTPConnection, body: dict, key: str = "") -> tuple[int, dict]:
  connection.request("POST", "/search", json.dumps(body),
                     {"Content-Type": "application/json", **authorization(key)})
  response = connection.getresponse()
  return response.status, json.loads(response.read())


def load(port: int, questions: list[str], clients: int, total: int, *, k: int = 10,
         unit: str = "phrase", key: str = "") -> dict:
  """`total` single-question searches from `clients` threads with a connection each."""
  latencies, errors, lock = [], [], threading.Lock()
  counter = iter(range(total))

  def client():
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while True:
      with lock:
        i = next(counter, None)
      if i is None:
        break
      start = time.perf_counter()
      try:
        status, answer = post(connection, {"question": questions[i % len(questions)], "k": k,
                                           "unit": unit}, key)
        ok = status == 200 and len(answer["results"]) > 0
      except (OSError, http.client.HTTPException, ValueError) as e:
        status, ok = repr(e), False
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
      with lock:
        latencies.append(time.perf_counter() - start)
        if not ok:
          errors.append(status)
    connection.close()

  seconds = run_clients(client, clients)
  ms = np.array(latencies) * 1e3
  return {"clients": clients, "requests": total, "seconds": seconds,
          "questions_per_s": total / seconds, "latency_p50_ms": float(np.percentile(ms, 50)),
          "latency_p99_ms": float(np.percentile(ms, 99)), "errors": len(errors),
          "error_examples": [str(e) for e in errors[:5]]}


def run_clients(client, clients: int) -> float:
  """Runs `client` in `clients` threads at once; the seconds until the last one ends."""
  threads = [threading.Thread(target=client) for _ in range(clients)]
  start = time.perf_counter()
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return time.perf_counter() - start


def server_stats(port: int, key: str = "") -> dict:
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    connection.request("GET", "/stats", headers=authorization(key))
    return json.loads(connection.getresponse().read())
  finally:
    connection.close()


def measured(port: int, questions: list[str], clients: int, total: int, **kwargs) -> dict:
  """`load`, with the micro-batches the server formed for these requests alone (/stats is
  cumulative: the difference of the counts before and after)."""
  before = server_stats(port, kwargs.get("key", ""))
  result = load(port, questions, clients, total, **kwargs)
  after = server_stats(port, kwargs.get("key", ""))
  batches = after.get("batches", 0) - before.get("batches", 0)
  asked = after.get("questions", 0) - before.get("questions", 0)
  return {**result, "server_batches": batches,
          "mean_batch_questions": asked / batches if batches else 0.0}


def wait_healthy(port: int, server: subprocess.Popen, timeout: float = 600) -> dict:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if server.poll() is not None:
      raise SystemExit(f"the server exited with status {server.returncode}")
    try:
      connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
      connection.request("GET", "/health")
      return json.loads(connection.getresponse().read())
    except OSError:
      time.sleep(0.5)
  raise SystemExit(f"no /health answer on port {port} within {timeout:.0f} s")


def screenshot(port: int, question: str, path: pathlib.Path, browser: str, key: str = "") -> dict:
  """Types `question` (and the API key, if any) into the page, waits for the highlighted
  answer, saves a screenshot."""
  from playwright.sync_api import sync_playwright
  with sync_playwright() as p:
    chromium = p.chromium.launch(executable_path=browser, args=["--no-sandbox"])
    page = chromium.new_page(viewport={"width": 1000, "height": 800})
    page.goto(f"http://127.0.0.1:{port}/")
    page.fill("#question", question)
    if key:  # the page shows its key field when /health says the service needs one
      page.fill("#key", key)
    page.select_option("#k", "5")
    page.click("#go")
    page.wait_for_selector(".result mark", timeout=60_000)
    shown = {"question": question, "first_answer": page.inner_text(".result .answer"),
             "first_mark": page.inner_text(".result mark"),
             "results": page.locator(".result").count()}
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=False)
    chromium.close()
  return shown


def render(r: dict, command: str) -> str:
  one, many = r["one_client"], r["concurrent"]
  rows = [f"| {name} | {x['clients']} | {x['requests']} | {x['questions_per_s']:.1f} | "
          f"{x['latency_p50_ms']:.1f} | {x['latency_p99_ms']:.1f} | {x['errors']} |"
          for name, x in (("one client", one), ("concurrent", many))]
  stats = r["server_stats"]
  lines = [
      "# Serving: `run.py serve` under load", "",
      f"Index: {r['health']['index']} over {r['health']['passages']} passages "
      f"({r['health']['vectors']} token vectors), model step {r['health']['model_step']}; "
      f"single-question POST /search, k={r['k']}, unit={r['unit']}"
      f"{', with an API key' if r.get('auth') else ''}, over loopback on this "
      f"machine ({os.cpu_count()} cores), server and clients in separate processes.", "",
      "| load | clients | requests | questions/s | p50 ms | p99 ms | errors |",
      "|---|---|---|---|---|---|---|", *rows, "",
      f"Concurrency gain (micro-batching): **{r['concurrency_gain']:.2f}x** one client's "
      f"questions/s. Micro-batches the server formed: {many['server_batches']} for the "
      f"concurrent requests, {many['mean_batch_questions']:.1f} questions on average (at most "
      f"{stats.get('largest_batch', 0)}); {one['server_batches']} for the one client's "
      f"({one['mean_batch_questions']:.1f} on average).", "",
      f"Server exit on SIGINT: status {r['server_exit']}.", "",
      "Command:", "", "```bash", command, "```"]
  if r.get("page"):
    page = r["page"]
    lines += ["", f"Web page (headless chromium via playwright): asked {page['question']!r}; "
              f"{page['results']} results, the first {page['first_answer']!r} with "
              f"{page['first_mark']!r} highlighted in its passage: "
              f"![search page]({pathlib.Path(r['screenshot']).name})"]
  return with_notes(lines, r.get("notes", []))


def server_arguments(parser: argparse.ArgumentParser, requests: int, out: str) -> None:
  """The serving benchmarks' common arguments: the workdir to serve, the clients, the report."""
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--clients", type=int, default=16)
  parser.add_argument("--requests", type=int, default=requests)
  parser.add_argument("--out", default=out)
  parser.add_argument("--note", action="append", default=[], help="a paragraph for the report")


def workload(args) -> tuple:
  """(the config, the workdir's evaluation questions, the `run.py serve` command on a free
  port) of the serving benchmarks' arguments."""
  from dpjax.config import load_config
  from dpjax.data.questions import read_questions
  from dpjax.loading import data_paths
  from dpjax.settings import Settings
  config = Settings.of(load_config(args.config, args.set))
  questions = [q.question for q in
               read_questions(data_paths(config.data, config.index,
                                         pathlib.Path(args.workdir))["questions"])]
  command = [sys.executable, "run.py", "serve", "--config", args.config, "--workdir",
             args.workdir] + [f"--set={s}" for s in args.set] + ["--set", "serve.port=0"]
  return config, questions, command


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  server_arguments(parser, requests=2000, out="results/serve.json")
  parser.add_argument("--single", type=int, default=300, help="requests of the one client")
  parser.add_argument("--k", type=int, default=10)
  parser.add_argument("--unit", default="phrase")
  parser.add_argument("--screenshot", help="a PNG of the web page after a search")
  parser.add_argument("--browser", default="/usr/bin/chromium")
  parser.add_argument("--auth", action="store_true", help="serve with a random API key")
  args = parser.parse_args(argv)

  _, questions, command = workload(args)
  key = secrets.token_urlsafe(24) if args.auth else ""
  server, port = start_serving(command, env={**os.environ, "DPJAX_API_KEY": key})
  try:
    health = wait_healthy(port, server)
    # warm the connections and caches
    load(port, questions, 4, 64, k=args.k, unit=args.unit, key=key)
    one = measured(port, questions, 1, args.single, k=args.k, unit=args.unit, key=key)
    many = measured(port, questions, args.clients, args.requests, k=args.k, unit=args.unit,
                    key=key)
    stats = server_stats(port, key)
    page = (screenshot(port, questions[0], pathlib.Path(args.screenshot), args.browser, key)
            if args.screenshot else None)
  finally:
    server.send_signal(signal.SIGINT)
    exit_status = server.wait(timeout=60)
  results = {"health": health, "auth": args.auth, "k": args.k, "unit": args.unit,
             "one_client": one,
             "concurrent": many, "concurrency_gain": many["questions_per_s"] /
             one["questions_per_s"], "server_stats": stats, "server_exit": exit_status,
             "page": page, "screenshot": args.screenshot, "notes": args.note}
  save_results(args.out, results, render, "experiments/benchmarks/serve_load.py",
               elide_notes(sys.argv[1:] if argv is None else argv))
  return results


if __name__ == "__main__":
  main()
