"""How dpjax scales with corpus size: dump, compact index, serve and search at 3.1M, 12.5M and
50M tokens of a synthetic corpus, projected to English Wikipedia (3e9 tokens).

  taskset -c 0 python experiments/benchmarks/scale.py --root /tmp/dpjax_scale \\
      --out results/scale.json

For each size in `--sizes` (word-piece tokens of the model's tokenizer), under `--root/<size>/`:
a synthetic corpus (`corpus.jsonl`: Wikipedia-like paragraphs of ~130 tokens, words drawn from
the tokenizer's whole-word vocabulary with a Zipf law, each about a made-up person with a
birth year and city; deterministic by `--seed`, written as a stream) and questions about some
of its people (`questions.jsonl`); then `run.py dump` and `run.py index` (one run per spec:
the compact `--spec`, then `--specs`) as subprocesses with the random encoder of
`experiments/demo.py:tiny` (`eval.allow_untrained`: no training), each timed with its peak
resident memory (GNU time's `%M`: `timed_run`). Then `run.py serve` over the compact index is
started and its resident memory read once /health answers (then SIGTERM); then an in-process
`dpjax.PhraseSearcher` over the compact index is timed at batch 1 (p50 latency) and batch 64
(top-10 phrases; questions encoded by the random encoder, so the answers are not right, only
timed), and its memory-mapped codes' faiss search is compared with a search of the same codes
loaded into memory. Bytes on disk per corpus token by part: the dump's files by kind, the compact
index's parts (its manifest's `parts`). Every size resumes: a size in `--out` is not measured
again, a complete dump or index is not built again (an interrupted dump resumes by shard), and
each stage's figures are kept in `<root>/<size>/stages.json` as it ends.

The projection to `--project-tokens` (English Wikipedia, before filtering) fits each cost
linearly in tokens over the measured sizes (a + b x tokens; one size: through zero): disk
(bytes per token, with the dump's vectors also at `--project-dim`), the resident memory of
serve and of the builds, build hours (the dump at `--encode-rate` tokens/s, default the GPU dump
rate of results/gpu_check.json; the compact index on this machine's CPU) and questions/s (the
compact index is searched exhaustively, so the time per question is fitted linearly in tokens).

Options: `--set` (passed to every `run.py`, e.g. `model.random.hidden_size=...`), `--note`.
"""
from __future__ import annotations

import argparse
import bisect
import itertools
import json
import logging
import os
import pathlib
import platform
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "benchmarks"))
from experiments.report import (  # noqa: E402
    command_line, elide_notes, git_commit, save_results, with_notes)

log = logging.getLogger("scale")

SIZES = [3_125_000, 12_500_000, 50_000_000]  # 16x
KEYS_SQUAD = ("em@1", "em@10", "top1", "top5", "top20", "mrr@20")
WIKIPEDIA_TOKENS = 3.0e9  # English Wikipedia's word-piece tokens (DensePhrases' 3B phrase dump)
# Issue 69's bounds for the SQuAD-open section: EM@1 and Top-1 within 1.0 of Flat's (and of the
# Flat hybrid figures the issue states), hybrid q/s at batch 64 and p50 ms at batch 1.
ACCURACY_BOUND = 1.0
ISSUE_FLAT_HYBRID = {"em@1": 46.05, "top1": 83.29}
QPS_BOUND, P50_BOUND_MS = 18.4, 100.0
# The random encoder: 64-d token vectors (D = hidden_size), so PQ16 codes 4-d sub-vectors.
MODEL_SETS = ["model.random.hidden_size=64", "model.random.num_attention_heads=4",
              "model.random.intermediate_size=128", "index.dump_max_seq_length=192",
              "eval.allow_untrained=True"]
DUMP_PARTS = ("vectors.npy", "char_spans.npy", "filter_logits.npy", "token_passage.npy",
              "passages.jsonl")
FUNCTION_WORDS = ("the", "of", "and", "in", "to", "a", "was", "is", "for", "on", "as", "by",
                  "with", "that", "from", "at", "his", "her", "which", "were", "it", "an")
SYLLABLES = ("ka", "lo", "mer", "vin", "do", "sa", "tor", "bel", "ru", "an", "dre", "th",
             "ol", "ma", "ni", "gar", "wen", "fi", "sto", "ley", "qu", "ix", "ber", "lan")


class CorpusMaker:
  """Passages of a synthetic Wikipedia-like corpus, each drawn from its own seeded generator:
  passage i is the same whatever is drawn before it (so any passage can be made again)."""

  def __init__(self, tokenizer, seed: int, words: tuple[int, int] = (90, 125)):
    vocab = sorted(w for w in tokenizer.backend.get_vocab()
                   if w.isascii() and w.isalpha() and w.islower() and len(w) >= 3)
    random.Random(seed).shuffle(vocab)  # the Zipf rank of each word, seeded
    self.vocab, self.seed, self.words = vocab, seed, words
    self.cumulative = list(itertools.accumulate(1 / (rank + 10) for rank in range(len(vocab))))

  def _rng(self, i: int, stream: int) -> random.Random:
    """Passage i's generator of its facts (stream 0) or of its text (stream 1)."""
    return random.Random((self.seed << 40) + 2 * i + stream)

  def _name(self, rng: random.Random, parts: int) -> str:
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(2, 3))).capitalize()
                    for _ in range(parts))

  def _sentence(self, rng: random.Random) -> list[str]:
    words = []
    for _ in range(rng.randint(8, 22)):
      if rng.random() < 0.4:
        words.append(rng.choice(FUNCTION_WORDS))
      elif rng.random() < 0.04:
        words.append(str(rng.randint(1000, 2020)))
      else:
        words.append(self.vocab[bisect.bisect(self.cumulative, rng.random()
                                              * self.cumulative[-1])])
    words[0] = words[0].capitalize()
    return words

  def facts(self, i: int) -> dict:
    """Passage i's person: name (the title), birth year and city."""
    rng = self._rng(i, 0)
    return {"name": self._name(rng, 2), "born": str(rng.randint(1700, 1990)),
            "city": self._name(rng, 1)}

  def passage(self, i: int) -> dict:
    """`{"id", "title", "text"}` of passage i."""
    facts, rng = self.facts(i), self._rng(i, 1)
    text = [f"{facts['name']} ({facts['born']} - {int(facts['born']) + rng.randint(30, 90)}) "
            f"was a {rng.choice(self.vocab)} {rng.choice(self.vocab)} born in {facts['city']}."]
    target, count = rng.randint(*self.words), len(text[0].split())
    while count < target:
      words = self._sentence(rng)
      text.append(" ".join(words) + ".")
      count += len(words)
    return {"id": f"p{i}", "title": facts["name"], "text": " ".join(text)}

  def question(self, i: int) -> dict:
    facts = self.facts(i)
    if i % 2:
      return {"id": f"q{i}", "question": f"When was {facts['name']} born?",
              "answers": [facts["born"]]}
    return {"id": f"q{i}", "question": f"Where was {facts['name']} born?",
            "answers": [facts["city"]]}


def tokens_per_passage(maker: CorpusMaker, tokenizer, sample: int = 400) -> float:
  """Mean word-piece tokens of the texts of passages 0..sample-1 (what the dump stores)."""
  texts = [maker.passage(i)["text"] for i in range(sample)]
  return float(np.mean([len(ids) for ids, _ in tokenizer.tokenize(texts)]))


def write_corpus(folder: pathlib.Path, tokens: int, maker: CorpusMaker, tokenizer,
                 questions: int) -> dict:
  """`corpus.jsonl` of about `tokens` tokens (streamed, renamed complete; reused when written
  before for the same tokens and seed) and `questions.jsonl`: `questions` questions about
  passages spread over it. Returns the corpus's record (`corpus.json`) with the questions'
  count."""
  record_path = folder / "corpus.json"
  want = {"tokens_requested": tokens, "seed": maker.seed}
  record = json.loads(record_path.read_text()) if record_path.is_file() else {}
  if {k: record.get(k) for k in want} != want or not (folder / "corpus.jsonl").is_file():
    folder.mkdir(parents=True, exist_ok=True)
    per_passage = tokens_per_passage(maker, tokenizer)
    passages = max(2, round(tokens / per_passage))
    start = time.perf_counter()
    _write_lines(folder / "corpus.jsonl", (maker.passage(i) for i in range(passages)))
    record = {**want, "passages": passages, "sample_tokens_per_passage": per_passage,
              "tokens_estimated": round(passages * per_passage),
              "bytes": (folder / "corpus.jsonl").stat().st_size,
              "seconds": time.perf_counter() - start}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
  passages = record["passages"]
  asked = np.unique(np.linspace(0, passages - 1, min(questions, passages)).astype(int))
  _write_lines(folder / "questions.jsonl", (maker.question(int(i)) for i in asked))
  return {**record, "questions": len(asked)}


def _write_lines(path: pathlib.Path, rows) -> None:
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


TIME = "/usr/bin/time"  # GNU time: a small process whose child's peak is the command's own


def timed_run(command: list[str], log_path: pathlib.Path) -> dict:
  """Runs `command` (output to `log_path`); its wall seconds, peak resident memory and exit
  status. A failure stops the study, naming the log.

  The peak is GNU time's (`%M`) where it is installed: a child forked from this process would
  carry this process's own peak into its rusage (Linux keeps a process's high-water mark across
  fork and exec), and this process grows with the corpus it writes. Without GNU time, the
  child's wait4 rusage (`peak_rss_source` says which)."""
  peak_file = log_path.with_suffix(".peak")
  wrapped = ([TIME, "-f", "%M", "-o", str(peak_file), *command] if os.access(TIME, os.X_OK)
             else command)
  with log_path.open("w") as out:
    start = time.perf_counter()
    child = subprocess.Popen(wrapped, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
  child.returncode = rc = os.waitstatus_to_exitcode(status)  # (reaped here, not by Popen)
  if rc:
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    raise SystemExit(f"{' '.join(command[:3])} failed (exit {rc}); {log_path}:\n" + "\n".join(tail))
  peak, source = usage.ru_maxrss, "wait4 rusage (this process's peak included)"
  if wrapped is not command:
    peak, source = int(peak_file.read_text().split()[-1]), "GNU time %M"
    peak_file.unlink()
  return {"wall_s": wall, "peak_rss_bytes": peak * 1024, "peak_rss_source": source,
          "cpu_s": usage.ru_utime + usage.ru_stime}


class SizeRun:
  """One size's folder (`<root>/<label>`): its corpus, workdir, run.py commands and the figures
  of its stages (`stages.json`, kept as each ends)."""

  def __init__(self, root: pathlib.Path, tokens: int, args):
    self.tokens, self.args = tokens, args
    self.folder = root / f"tokens_{tokens}"
    self.workdir = self.folder / "workdir"
    self.dump = self.workdir / "dump"
    self.stages_path = self.folder / "stages.json"
    self.stages = json.loads(self.stages_path.read_text()) if self.stages_path.is_file() else {}

  def sets(self, spec: str | None = None) -> list[str]:
    corpus, questions = self.folder / "corpus.jsonl", self.folder / "questions.jsonl"
    sets = [*MODEL_SETS, f"index.corpus=[{str(corpus)!r}]", f"index.questions={questions}",
            *self.args.set]
    return sets + ([f"index.specs=[{spec!r}]"] if spec else [])

  def command(self, mode: str, sets: list[str]) -> list[str]:
    return [sys.executable, "run.py", mode, "--config", self.args.config, "--workdir",
            str(self.workdir), *(a for s in sets for a in ("--set", s))]

  def stage(self, name: str, done: bool, mode: str, sets: list[str], **notes) -> dict:
    """The figures of stage `name` (`run.py mode`), with `notes`: measured now unless `done`
    already."""
    if done and name in self.stages:
      return self.stages[name]
    if done:  # complete, but not made by this study: no figures
      return {"skipped": "complete before this study ran"}
    log.info("%s: %s", self.folder.name, name)
    self.stages[name] = {**timed_run(self.command(mode, sets), self.folder / f"{name}.log"),
                         **notes}
    self.stages_path.write_text(json.dumps(self.stages, indent=1) + "\n")
    return self.stages[name]

  def index_dir(self, spec: str) -> pathlib.Path:
    from dpjax.index.faiss_index import index_folder
    return self.dump / "indexes" / index_folder(spec)


def dump_complete(dump: pathlib.Path) -> bool:
  path = dump / "manifest.json"
  return path.is_file() and bool(json.loads(path.read_text()).get("complete"))


def disk_bytes(dump: pathlib.Path, index: pathlib.Path, corpus: pathlib.Path) -> dict:
  """Bytes on disk per stored token: the corpus file, the dump's files by kind, the compact
  index's parts (its manifest, passages included), and what a compact index's search reads:
  the compact index and the dump's manifest."""
  manifest = json.loads((dump / "manifest.json").read_text())
  tokens = manifest["num_tokens"]
  dump_parts = dict.fromkeys(DUMP_PARTS, 0)
  for shard in manifest["shards"]:
    for name, record in shard["files"].items():
      dump_parts[name] = dump_parts.get(name, 0) + record["bytes"]
  compact = json.loads((index / "index_manifest.json").read_text())
  per = {"corpus.jsonl": corpus.stat().st_size / tokens,
         "dump": {name: size / tokens for name, size in dump_parts.items()},
         "compact": {name: part["per_token"] for name, part in compact["parts"].items()}}
  per["dump_total"] = sum(per["dump"].values())
  per["compact_total"] = compact["bytes_per_token"]
  per["served"] = per["compact_total"] + (dump / "manifest.json").stat().st_size / tokens
  return per


def serve_memory(run: SizeRun, index_name: str) -> dict:
  """`run.py serve` over the compact index: seconds until /health answers, then its resident
  memory (VmRSS, with its anonymous and file-backed parts, and the peak VmHWM of its start);
  stopped with SIGTERM."""
  from serve_load import start_serving, wait_healthy
  sets = run.sets() + ["serve.port=0", f"serve.index={index_name}", "serve.api_key_env="]
  start = time.perf_counter()
  server, port = start_serving(run.command("serve", sets))
  try:
    wait_healthy(port, server)
    seconds = time.perf_counter() - start
    status = dict(line.split(":", 1) for line in
                  pathlib.Path(f"/proc/{server.pid}/status").read_text().splitlines())
  finally:
    server.send_signal(signal.SIGTERM)
    rc = server.wait(timeout=120)
  memory = {key: int(status[key].split()[0]) * 1024
            for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
  return {"start_s": seconds, **{f"{k.lower()}_bytes": v for k, v in memory.items()},
          "exit": rc}


def timed_search(searcher, questions: list[str], batch: int, batches: int) -> dict:
  """Questions/s and latency percentiles of `searcher.search` (top-10 phrases) in batches
  (`timing.time_searches`)."""
  from timing import time_searches
  return time_searches({"searcher": searcher}, questions, batch, batches, k=10,
                       unit="phrase")["searcher"]


def mapped_matches_loaded(phrase_index, q_start: np.ndarray, q_end: np.ndarray) -> dict:
  """Whether the compact index's search over its memory-mapped codes returns the labels and
  scores of a search of the same codes copied into memory (a faiss index owning them; a
  residual index's passage-first search over copies of its codes, means and offsets)."""
  import dataclasses

  import faiss

  from dpjax.index.compact import flat_codes
  compact = phrase_index.compact
  if compact.means is not None:
    loaded = dataclasses.replace(compact, **{  # read whole, not mapped
        name: np.array(getattr(compact, name)) for name in ("codes", "means", "kept_offsets")}
        ).searcher(phrase_index.index.nprobe)
  else:
    loaded = faiss.clone_index(compact.codec)
    inner = flat_codes(loaded)
    inner.add_sa_codes(np.ascontiguousarray(np.array(compact.codes)))  # read whole, not mapped
    loaded.ntotal = inner.ntotal
  differ = 0
  for queries in (q_start, q_end):
    mapped_scores, mapped_ids = phrase_index.index.search(queries, 10)
    loaded_scores, loaded_ids = loaded.search(queries, 10)
    differ += int(np.sum(np.any((mapped_ids != loaded_ids) | (mapped_scores != loaded_scores),
                                axis=1)))
  return {"questions": len(q_start), "searches_that_differ": differ, "identical": differ == 0}


def search_figures(run: SizeRun, index_name: str) -> dict:
  """An in-process `PhraseSearcher` over the compact index: load seconds, questions/s and p50 /
  p99 latency at batch 1 and 64, and the memory-mapped search against a loaded copy."""
  from dpjax.config import load_settings
  from dpjax.data.questions import read_questions
  from dpjax.main import open_searcher
  settings = load_settings(run.args.config, run.sets())
  start = time.perf_counter()
  searcher, _ = open_searcher(settings, run.workdir, index_name)
  load_s = time.perf_counter() - start
  questions = [q.question for q in read_questions(run.folder / "questions.jsonl")]
  searcher.search(questions[:64], k=10, unit="phrase")  # compiles: not timed
  searcher.search(questions[:1], k=10, unit="phrase")
  out = {"load_s": load_s, "batch1": timed_search(searcher, questions, 1, run.args.batch1),
         "batch64": timed_search(searcher, questions, 64, run.args.batches64)}
  q_start, q_end = searcher.encode(questions[:64])
  out["mapped_vs_loaded"] = mapped_matches_loaded(searcher.index, q_start, q_end)
  return out


def measure_size(tokens: int, args, tokenizer, maker: CorpusMaker) -> dict:
  """Every figure of one size (its stages resumed from `stages.json`)."""
  run = SizeRun(pathlib.Path(args.root), tokens, args)
  corpus = write_corpus(run.folder, tokens, maker, tokenizer, args.questions)
  row = {"tokens_requested": tokens, "corpus": corpus}
  done = dump_complete(run.dump)
  # An interrupted dump resumes by shard: its figures are then those of the shards left.
  resumed = {"resumed": True} if not done and run.dump.is_dir() else {}
  row["dump"] = run.stage("dump", done, "dump", run.sets(), **resumed)
  manifest = json.loads((run.dump / "manifest.json").read_text())
  row.update(tokens=manifest["num_tokens"], passages=manifest["num_passages"],
             dim=manifest["dim"], encoded_tokens=manifest.get("encoded_tokens"),
             dump_encoding_s=manifest.get("seconds"))
  row["index"] = {}
  for spec in [args.spec, *args.specs]:
    done = (run.index_dir(spec) / "index_manifest.json").is_file()
    row["index"][spec] = run.stage(f"index {spec}", done, "index", run.sets(spec))
    index_manifest = json.loads((run.index_dir(spec) / "index_manifest.json").read_text())
    row["index"][spec]["build_s"] = index_manifest["build_seconds"]
  name = run.index_dir(args.spec).name
  row["bytes_per_token"] = disk_bytes(run.dump, run.index_dir(args.spec),
                                      run.folder / "corpus.jsonl")
  if args.serve:
    log.info("%s: serve", run.folder.name)
    row["serve"] = serve_memory(run, name)
  log.info("%s: search", run.folder.name)
  row["search"] = search_figures(run, name)
  return row


def linear_fit(xs, ys) -> tuple[float, float]:
  """(intercept, slope) of the least-squares line through (xs, ys); one point: through zero."""
  xs, ys = np.asarray(xs, float), np.asarray(ys, float)
  if len(xs) < 2:
    return 0.0, float(ys[0] / xs[0])
  slope, intercept = np.polyfit(xs, ys, 1)
  return float(intercept), float(slope)


def fitted(rows: list[dict], value, tokens: float) -> dict | None:
  """`value(row)` fitted linearly in tokens over the rows that have it (None where it is
  missing: a stage skipped), and its value at `tokens`; None if no row has it."""
  points = [(r["tokens"], value(r)) for r in rows]
  points = [(x, y) for x, y in points if y is not None]
  if not points:
    return None
  a, b = linear_fit(*zip(*points))
  return {"intercept": a, "per_token": b, "projected": a + b * tokens}


def projection(rows: list[dict], args) -> dict:
  """Each cost at `args.project_tokens` from the measured sizes (linear in tokens)."""
  T, spec = args.project_tokens, args.spec
  last, dim = rows[-1]["bytes_per_token"], rows[-1]["dim"]
  out = {"tokens": T, "project_dim": args.project_dim, "measured_dim": dim, "disk_bytes": {
      "dump": last["dump_total"] * T,
      "dump_at_project_dim": (last["dump_total"] + 2 * (args.project_dim - dim)) * T,
      "compact_index": last["compact_total"] * T, "served": last["served"] * T}}
  memory = {"serve_rss_bytes": lambda r: r.get("serve", {}).get("vmrss_bytes"),
            "serve_anon_bytes": lambda r: r.get("serve", {}).get("rssanon_bytes"),
            "dump_peak_rss_bytes": lambda r: r["dump"].get("peak_rss_bytes"),
            "index_peak_rss_bytes": lambda r: r["index"][spec].get("peak_rss_bytes")}
  for key, value in memory.items():
    if (fit := fitted(rows, value, T)) is not None:
      # Memory that fell with the size is the measurement's noise where it is flat: projected
      # at the largest measured, not below what was measured.
      if fit["per_token"] < 0:
        top = max(y for r in rows if (y := value(r)) is not None)
        fit = {"intercept": top, "per_token": 0.0, "projected": top, "flat": True}
      out[key] = fit
  build = fitted(rows, lambda r: r["index"][spec]["build_s"], T)
  out["hours"] = {"dump": T / args.encode_rate / 3600, "encode_rate": args.encode_rate,
                  "encode_rate_source": args.encode_rate_source,
                  "compact_index": build["projected"] / 3600}
  for batch in ("batch1", "batch64"):
    seconds = [1 / r["search"][batch]["questions_per_s"] for r in rows]
    fit = fitted(rows, lambda r: 1 / r["search"][batch]["questions_per_s"], T)
    # A time per question that fell with the size (the timing's noise where the search costs
    # about the same at every size measured) is projected flat, not to a negative time.
    flat = fit["per_token"] < 0
    if flat:
      fit = {"intercept": float(np.mean(seconds)), "per_token": 0.0,
             "projected": float(np.mean(seconds))}
    out[f"questions_per_s_{batch}"] = {
        "seconds_per_question_at_0": fit["intercept"],
        "seconds_per_question_per_token": fit["per_token"], "flat": flat,
        "projected": 1 / fit["projected"] if fit["projected"] > 0 else None}
  return out


def _gb(x) -> str:
  return "-" if x is None else f"{x / 2 ** 30:,.2f}"


def _f(x, fmt: str = ".1f") -> str:
  return "-" if x is None else format(x, fmt)


def render(results: dict, command: str) -> str:
  spec, cores = results["spec"], results["cores"]
  per_passage = (sum(r["tokens"] for r in results["rows"])
                 / sum(r["passages"] for r in results["rows"]))
  lines = ["# Scale study (experiments/benchmarks/scale.py)", "",
           f"Rendered by `{command}` at {results['commit'][:12]} on {results['machine']} "
           f"({cores} core{'s' if cores > 1 else ''} in use). Random encoder of "
           f"`{results['config']}` "
           f"(`{' '.join(results['model_sets'])}`); compact index `{spec}`; a synthetic corpus "
           f"(passages of {per_passage:.0f} word-piece tokens on average).", "",
           "| tokens | passages | dump s (encoding tokens/s) | dump peak GiB | index s (build) "
           "| index peak GiB | serve start s | serve RSS GiB (anon / file) | q/s batch 1 | p50 ms "
           "batch 1 | q/s batch 64 | p50 ms batch 64 | mmap = loaded |", "|---" * 13 + "|"]
  for r in results["rows"]:
    dump, index, serve = r["dump"], r["index"][spec], r.get("serve", {})
    b1, b64 = r["search"]["batch1"], r["search"]["batch64"]
    rate = r["tokens"] / r["dump_encoding_s"] if r.get("dump_encoding_s") else None
    lines.append(
        f"| {r['tokens']:,} | {r['passages']:,} | {_f(dump.get('wall_s'), '.0f')} "
        f"({_f(rate, ',.0f')}) | {_gb(dump.get('peak_rss_bytes'))} | "
        f"{_f(index.get('wall_s'), '.0f')} ({index['build_s']:.0f}) | "
        f"{_gb(index.get('peak_rss_bytes'))} | {_f(serve.get('start_s'))} | "
        f"{_gb(serve.get('vmrss_bytes'))} ({_gb(serve.get('rssanon_bytes'))} / "
        f"{_gb(serve.get('rssfile_bytes'))}) | {b1['questions_per_s']:.1f} | {b1['p50_ms']:.1f} | "
        f"{b64['questions_per_s']:.1f} | {b64['p50_ms']:.0f} | "
        f"{'yes' if r['search']['mapped_vs_loaded']['identical'] else '**no**'} |")
  commits = sorted({r.get("commit", "")[:12] for r in results["rows"]}
                   - {results["commit"][:12]})
  if commits:
    lines += ["", f"Some sizes were measured by an earlier run, at {', '.join(commits)}."]
  lines += ["", "Wall seconds are each `run.py` process's, start-up and compiling included (the "
            "encoding rate: the dump manifest's encoding seconds); peak GiB its peak resident "
            "memory. Serve: `run.py serve` over the compact index, its resident memory once "
            "/health answers (its start compiles the question encoder where the XLA cache lacks "
            "it); questions/s: an in-process `PhraseSearcher`, top-10 phrases. mmap = loaded: the "
            "faiss search of the memory-mapped codes returns the labels and scores of the same "
            "codes loaded into memory, for 64 questions."]
  lines += _bytes_table(results)
  lines += _projection_lines(results)
  text = with_notes(lines, results.get("notes", []))
  if results.get("squad_open"):
    text += "\n" + squad_section(results["squad_open"])
  return text


def render_all(results: dict) -> str:
  """The whole report of a results file (the synthetic sizes' command as recorded); a file of
  compact_squad.py's section alone (no synthetic sizes) renders that section."""
  if "rows" not in results:
    return "# SQuAD-open small (experiments/benchmarks/compact_squad.py)\n\n" + squad_section(
        results["squad_open"]).split("\n", 2)[2]
  return render(results, results.get("command", "experiments/benchmarks/scale.py"))


def squad_section(s: dict) -> str:
  """The SQuAD-open section (experiments/benchmarks/compact_squad.py writes it)."""
  from experiments.report import p_text
  lines = ["## SQuAD-open small: the compact index against Flat", "",
           f"Command: `{s['command']}` at {s['commit'][:12]}; model step {s['model_step']} of "
           f"`{s['config']}`; codec `{s['codec']}`, filter threshold {s['filter_threshold']}; "
           f"{s['questions']:,} dev questions.", "",
           "| search | tokens searched | question encoders | hybrid weights (passage, "
           "sentence) | " + " | ".join(KEYS_SQUAD) + " | q/s (eval) |",
           "|---" * (len(KEYS_SQUAD) + 5) + "|"]
  for name, row in s["rows"].items():
    weights = row.get("hybrid") and f"{row['hybrid']['weight']:g}, " \
        f"{row['hybrid']['sentence_weight']:g}"
    lines.append(f"| {name} | {row['index_tokens']:,} | "
                 f"{row.get('checkpoint', 'latest')} (step {row.get('model_step', '?')})"
                 + (f", re-read spans scored by {row['reread_scored_by']}"
                    if row.get("reread_scored_by") else "") + " | "
                 f"{weights or '-'} | "
                 + " | ".join(_f(row.get(k), ".2f") for k in KEYS_SQUAD)
                 + f" | {row['questions_per_s_eval']:.1f} |")
  lines += ["", "McNemar's exact test (questions right only in the first / only in the second, "
            "two-sided p):", ""]
  for pair, tests in s["paired"].items():
    lines.append(f"- {pair}: " + "; ".join(
        f"{k} {a} / {b}, p = {p_text(p)}" for k, (a, b, p) in tests.items()))
  if s.get("speed"):
    speed = s["speed"].get("rows", s["speed"])  # (before the timing recorded its commit: rows)
    when = f" at {s['speed']['commit'][:12]}" if "commit" in s["speed"] else ""
    lines += ["", f"Hybrid search timed{when} in one process, the indexes alternating (question "
              "encoding included, top-10 phrases):", "",
              "| search | p50 ms batch 1 | p90 ms batch 1 | q/s batch 64 (median batch) |",
              "|---|---|---|---|"]
    for name, t in speed.items():
      lines.append(f"| {name} | {t['batch1_p50_ms']:.1f} | {t['batch1_p90_ms']:.1f} | "
                   f"{t['batch64_questions_per_s']:.1f} |")
  lines += _bounds_lines(s)
  b = s["served_bytes"]
  lines += ["", f"Bytes on disk per corpus token ({b['corpus_tokens']:,} tokens) of everything "
            "the compact hybrid search reads:", "", "| part | bytes | per token |", "|---|---|---|"]
  for name, size in b["bytes"].items():
    lines.append(f"| {name} | {size:,} | {b['per_token'][name]:.3f} |")
  verdict = "met" if b["total_per_token"] <= s["bytes_budget"] else "**not met**"
  lines.append(f"| all | {sum(b['bytes'].values()):,} | {b['total_per_token']:.2f} "
               f"(bound {s['bytes_budget']:g}: {verdict}) |")
  wikipedia = b["total_per_token"] * WIKIPEDIA_TOKENS
  lines += ["", f"Projected to English Wikipedia ({WIKIPEDIA_TOKENS:.0e} tokens) at these bytes "
            f"per token: **{wikipedia / 1e9:.1f} GB** on disk (bound 48 GB: "
            f"{'met' if wikipedia <= 48e9 else '**not met**'}). Assumed: Wikipedia's passages "
            "keep as many tokens through the filter, hold as many distinct BM25 terms per token "
            "and compress as well as SQuAD-open's (its paragraphs are Wikipedia's); the BM25 "
            "vocabulary and the codec, fixed costs here, are counted per token as if they grew "
            "with the corpus (an overstatement)."]
  return with_notes(lines, s.get("notes", []))


def _bounds_lines(s: dict) -> list[str]:
  """Each compact row against the accuracy and speed bounds, computed from the rows: its EM@1 and
  Top-1 minus its Flat row's (the same search, dense or hybrid) and, for hybrid rows, minus the
  issue's Flat hybrid figures; a timed row's q/s at batch 64 and p50 at batch 1."""
  def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"

  def gaps(row: dict, base: dict) -> str:
    d = [row[k] - base[k] for k in ("em@1", "top1")]
    return f"{d[0]:+.2f} / {d[1]:+.2f} ({verdict(min(d) >= -ACCURACY_BOUND)})"

  speed = s.get("speed") or {}
  speed = speed.get("rows", speed)  # (before the timing recorded its commit: the rows alone)
  lines = ["", f"Against the bounds (EM@1 / Top-1 within {ACCURACY_BOUND:g} of Flat's; "
           f"the issue's Flat hybrid {ISSUE_FLAT_HYBRID['em@1']} / {ISSUE_FLAT_HYBRID['top1']}; "
           f"q/s at batch 64 >= {QPS_BOUND:g}; p50 at batch 1 <= {P50_BOUND_MS:g} ms):", "",
           "| search | EM@1 / Top-1 minus Flat's | minus the issue's | q/s batch 64 | "
           "p50 ms batch 1 |", "|---|---|---|---|---|"]
  for name, row in s["rows"].items():
    if name.startswith("Flat") or ", " not in name:
      continue
    kind = name.split(", ")[1]
    flat = s["rows"].get(f"Flat, {kind}")
    issue = gaps(row, ISSUE_FLAT_HYBRID) if kind == "hybrid" else "-"
    timed = speed.get(name)
    qps = p50 = "-"
    if timed:
      qps = (f"{timed['batch64_questions_per_s']:.2f} "  # (.2f: a verdict by the bound's side)
             f"({verdict(timed['batch64_questions_per_s'] >= QPS_BOUND)})")
      p50 = f"{timed['batch1_p50_ms']:.0f} ({verdict(timed['batch1_p50_ms'] <= P50_BOUND_MS)})"
    lines.append(f"| {name} | {gaps(row, flat) if flat else '-'} | {issue} | {qps} | {p50} |")
  return lines


def _bytes_table(results: dict) -> list[str]:
  rows = results["rows"]
  lines = ["", "Bytes on disk per stored token, by part:", "",
           "| part | " + " | ".join(f"{r['tokens']:,}" for r in rows) + " |",
           "|---" * (len(rows) + 1) + "|"]
  names = [("corpus.jsonl", lambda b: b["corpus.jsonl"])]
  dump = dict.fromkeys([*DUMP_PARTS, *(n for r in rows for n in r["bytes_per_token"]["dump"])])
  names += [(f"dump {n}", lambda b, n=n: b["dump"].get(n, 0.0)) for n in dump]
  names += [("dump, all", lambda b: b["dump_total"])]
  parts = dict.fromkeys(n for r in rows for n in r["bytes_per_token"]["compact"])
  names += [(f"compact {n}", lambda b, n=n: b["compact"].get(n, 0.0)) for n in parts]
  names += [("compact, all", lambda b: b["compact_total"]),
            ("served (compact + the dump's manifest)", lambda b: b["served"])]
  for label, get in names:
    lines.append(f"| {label} | " + " | ".join(f"{get(r['bytes_per_token']):.2f}" for r in rows)
                 + " |")
  return lines


def _projection_lines(results: dict) -> list[str]:
  p = results["projection"]
  disk, hours = p["disk_bytes"], p["hours"]
  lines = ["", f"## Projected to {p['tokens']:.1e} tokens (English Wikipedia)", "",
           "Each cost fitted as a + b x tokens over the measured sizes.", "",
           "| figure | projected | per token (fitted) |", "|---|---|---|",
           f"| dump on disk (D = {p['measured_dim']}) | {_gb(disk['dump'])} GiB | |",
           f"| dump on disk (D = {p['project_dim']}) | {_gb(disk['dump_at_project_dim'])} GiB | |",
           f"| compact index on disk | {_gb(disk['compact_index'])} GiB | |",
           f"| served from disk (compact, passages included) | {_gb(disk['served'])} GiB | |"]
  for key, label in (("serve_rss_bytes", "serve resident memory"),
                     ("serve_anon_bytes", "serve anonymous memory"),
                     ("dump_peak_rss_bytes", "dump peak resident memory"),
                     ("index_peak_rss_bytes", "compact index build peak resident memory")):
    if key in p:
      lines.append(f"| {label} | {_gb(p[key]['projected'])} GiB | {p[key]['per_token']:.2f} B"
                   + (" (fell with size: held at the largest measured)"
                      if p[key].get("flat") else "") + " |")
  lines += [f"| dump hours at {hours['encode_rate']:,.0f} tokens/s ({hours['encode_rate_source']})"
            f" | {hours['dump']:.1f} h | |",
            f"| compact index build hours (this CPU) | {hours['compact_index']:.1f} h | |"]
  for batch in ("batch1", "batch64"):
    q = p[f"questions_per_s_{batch}"]
    lines.append(f"| questions/s, {batch.replace('batch', 'batch ')} | {_f(q['projected'], '.3g')}"
                 f" | {q['seconds_per_question_per_token'] * 1e9:.3g} s per question per 1e9 "
                 "tokens" + (" (the measured time fell with size: held flat)"
                             if q.get("flat") else "") + " |")
  lines += ["", _search_assumed(results.get("spec", "")) + ", with the random "
            "encoder's question encoding; the dump hours assume the encoding rate given and no "
            "other bottleneck (the corpus read and the shards written as fast). The builds' "
            "memory grows linearly only once a size fills a dump shard (index.shard_passages "
            "passages) and the codec's training sample (index.train_size tokens): fits over "
            "smaller sizes overstate it. Serve's memory is read before any search: a search "
            "maps the codes it scans (file-backed pages the kernel can reclaim)."]
  return lines


def _search_assumed(spec: str) -> str:
  """What the projected questions/s assume of the search of the compact index `spec`."""
  from dpjax.index import compact, residual
  if "pr" in residual.parse(compact.codec_spec(spec, 1))[0]:
    return ("Questions/s assume the residual compact index's passage-first search (every "
            "passage's coded mean scanned, then the kept tokens of index.nprobe passages: its "
            "time per question linear in passages, on the cores in use here)")
  return ("Questions/s assume the compact index's exhaustive scan of every code (its search "
          "time per question linear in tokens, on the cores in use here)")


def encode_rate_default() -> tuple[float, str]:
  """The GPU dump's stored tokens/s of results/gpu_check.json, if recorded."""
  path = REPO / "results" / "gpu_check.json"
  if path.is_file():
    rate = json.loads(path.read_text()).get("figures", {}).get("dump_stored_tokens_per_s")
    if rate:
      return float(rate), "results/gpu_check.json's GPU dump"
  return 0.0, ""


def machine() -> str:
  """The CPU's model name (/proc/cpuinfo), else the platform's machine."""
  cpuinfo = pathlib.Path("/proc/cpuinfo")
  names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.is_file() else []
  return names[0].strip() if names else platform.machine()


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", required=True, help="a folder per size goes here")
  parser.add_argument("--sizes", nargs="+", type=float, default=SIZES,
                      help="corpus tokens (3.2e6 or 3200000)")
  parser.add_argument("--config", default="experiments/demo.py:tiny")
  parser.add_argument("--spec", default="compact:PQ16", help="the compact index searched")
  parser.add_argument("--specs", nargs="*", default=[], help="more indexes built and timed")
  parser.add_argument("--set", action="append", default=[], help="for every run.py")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--questions", type=int, default=320, help="questions written per size")
  parser.add_argument("--batch1", type=int, default=64, help="questions timed one at a time")
  parser.add_argument("--batches64", type=int, default=4, help="batches of 64 timed")
  parser.add_argument("--no-serve", dest="serve", action="store_false")
  parser.add_argument("--encode-rate", type=float, default=0.0,
                      help="tokens/s of the projected dump (default: results/gpu_check.json's)")
  parser.add_argument("--project-tokens", type=float, default=WIKIPEDIA_TOKENS)
  parser.add_argument("--project-dim", type=int, default=384,
                      help="the dump's vectors also projected at this dimension (MiniLM's)")
  parser.add_argument("--out", default="results/scale.json")
  parser.add_argument("--note", action="append", default=None, help="a paragraph for the report")
  args = parser.parse_args(argv)
  args.sizes = [int(s) for s in args.sizes]
  args.encode_rate_source = "--encode-rate"
  if not args.encode_rate:
    args.encode_rate, args.encode_rate_source = encode_rate_default()
  if not args.encode_rate:
    parser.error("no results/gpu_check.json dump rate: give --encode-rate")
  return args


def main(argv=None) -> int:
  args = parse(argv)
  from dpjax.config import setup_logging
  setup_logging(fmt="%(asctime)s %(name)s: %(message)s")
  from dpjax.data import Tokenizer
  from dpjax.config import load_settings
  model = load_settings(args.config, [*MODEL_SETS, *args.set]).model
  tokenizer = Tokenizer.from_pretrained(model.tokenizer)
  maker = CorpusMaker(tokenizer, args.seed)
  out = pathlib.Path(args.out)
  earlier = json.loads(out.read_text()) if out.is_file() else {}
  # Sizes measured before with these settings are kept, not measured again.
  setup = {"spec": args.spec, "config": args.config, "model_sets": [*MODEL_SETS, *args.set],
           "seed": args.seed}
  done = {r["tokens_requested"]: r for r in earlier.get("rows", [])
          if {k: r.get(k) for k in setup} == setup}
  results = {"commit": git_commit(), "machine": machine(),
             "cores": len(os.sched_getaffinity(0)), "config": args.config,
             "model_sets": [*MODEL_SETS, *args.set], "spec": args.spec, "seed": args.seed,
             "notes": earlier.get("notes", []) if args.note is None else args.note, "rows": []}
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  results["command"] = command_line("experiments/benchmarks/scale.py", argv)
  if earlier.get("squad_open"):  # (compact_squad.py's section, kept)
    results["squad_open"] = earlier["squad_open"]
  for tokens in sorted(args.sizes):
    if tokens not in done:
      done[tokens] = {**setup, "commit": results["commit"],
                      **measure_size(tokens, args, tokenizer, maker)}
    results["rows"] = [done[t] for t in sorted(done)]
    results["projection"] = projection(results["rows"], args)
    save_results(out, results, render, "experiments/benchmarks/scale.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
