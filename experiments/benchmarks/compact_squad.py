"""The compact index against the Flat one on SQuAD-open small: every dev question, dense and
hybrid, the bytes per corpus token by part, and the speed of hybrid search.

  taskset -c 1 python experiments/benchmarks/compact_squad.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --codec OPQ24,PQ24 --out results/scale.json \\
      [--compact-set eval.checkpoint=qsft] [--reread 3 --reread-set index.sparse_weight=1 ...]

It needs the workdir's complete float16 dump and, for `--threshold filter`, `run.py filter`'s
filter_results.json (its chosen threshold). Through run.py (what is missing is run, everything
with --rerun): `index` of Flat with the BM25 index (its hybrid weights chosen on training
questions), `index` of `compact:<codec>` at the threshold (without `index.sparse`: the weights
the BM25 index records are left as they are), then `eval` of each index dense
(`index.sparse=False`) and hybrid. McNemar's exact test pairs each compact row with the Flat row
of the same search (EM@1, passage Top-1, Top-20). Then, in this process, one searcher per index
is timed on the same questions: batch 1 (p50 / p90 latency) and batch 64 (questions/s), question
encoding included, alternating the two indexes batch by batch so that both see the same machine.
Bytes per corpus token (the dump's tokens, before filtering) by part: the compact index's files,
the BM25 index's files, and what else a search over them reads (the dump's manifest).

`--reread R` (repeatable) adds the compact hybrid search re-reading each question's top R passages
(`index.reread`; `--reread-set` for those rows only, e.g. the hybrid weights chosen with it),
`--reread-dense R` the dense one (evaluated, not timed), `--reread-margin R:M` the hybrid one
re-reading at most R passages, those holding a span within M of the best (`index.reread_margin`);
with `--window W` the hybrid re-reading rows read W word pieces around a passage's best span
(`index.reread_window`); `--reread-dense-set` applies to the dense re-reading rows only (named in
them: ", reread_window 128", ", nprobe 2048"); `--reread-dense-qsft` adds each dense re-reading row
again with QSFT's question encoders ranking the candidates and the trained ones scoring the
re-read spans (`index.reread_checkpoint`).
Timed questions are a seeded shuffle of the file (SQuAD lists a passage's questions together: in
file order a batch would re-read far fewer passages than a service's questions make it), and
re-reading's cache holds nothing while timed (every passage encoded cold).

The section is written into `--out` under "squad_open" (the scale study's other figures kept) and
its Markdown re-rendered by experiments/benchmarks/scale.py's `render`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shlex
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "benchmarks"))
from experiments.report import command_line, elide_notes, git_commit  # noqa: E402

log = logging.getLogger("compact_squad")
KEYS = ("em@1", "em@10", "top1", "top5", "top20", "mrr@20")
PAIRED = ("em@1", "top1", "top20")
BYTES_BUDGET = 16.0  # the bound on served bytes per corpus token
TIMING_SEED = 5  # the timed questions' order


def run_py(mode: str, args, overrides: list[str]) -> str:
  """Runs `python run.py MODE` over the workdir (an error stops the study); its command."""
  import subprocess
  argv = [sys.executable, "run.py", mode, "--config", args.config, "--workdir", args.workdir]
  for value in [*overrides, *args.set]:
    argv += ["--set", value]
  log.info("running %s", shlex.join(argv[1:]))
  subprocess.run(argv, cwd=REPO, check=True)
  return shlex.join(["python", *argv[1:]])


def threshold_of(args) -> float | None:
  """The filter threshold: a number, "none", or "filter" (run.py filter's choice)."""
  if args.threshold == "none":
    return None
  if args.threshold == "filter":
    path = pathlib.Path(args.workdir) / "filter_results.json"
    if not path.is_file():
      raise SystemExit(f"{path}: no filter results; run `run.py filter` first or give "
                       "--threshold")
    return json.loads(path.read_text())["chosen"]["threshold"]
  return float(args.threshold)


def systems(args, threshold: float | None) -> dict:
  """{row: (index spec, search_index, eval overrides)} of the four evaluated searches (the
  compact rows with `--compact-set` too, e.g. QSFT's question encoders)."""
  from dpjax.index.faiss_index import index_folder
  compact = f"compact:{args.codec}"
  folder = index_folder(compact, threshold)
  flat = ["index.search_index=Flat"]
  coded = [f"index.search_index={folder}", *args.compact_set]
  rows = {
      "Flat, dense": ("Flat", "Flat", flat + ["index.sparse=False"]),
      "Flat, hybrid": ("Flat", "Flat", flat + ["index.sparse=True"]),
      f"compact {args.codec}, dense": (compact, folder, coded + ["index.sparse=False"]),
      f"compact {args.codec}, hybrid": (compact, folder, coded + ["index.sparse=True"]),
  }
  # (the hybrid re-reading rows read --window word pieces around their best span, if given)
  window = [f"index.reread_window={args.window}"] if args.window else []
  around = f", window {args.window}" if args.window else ""
  for passages in args.reread:
    rows[f"compact {args.codec}, hybrid, reread {passages}{around}"] = (
        compact, folder, coded + ["index.sparse=True", f"index.reread={passages}", *window,
                                  *args.reread_set])
  for passages, margin in args.reread_margin:
    rows[f"compact {args.codec}, hybrid, reread {passages} within {margin:g}{around}"] = (
        compact, folder, coded + ["index.sparse=True", f"index.reread={passages}", *window,
                                  f"index.reread_margin={margin}", *args.reread_set])
  # (--reread-dense-set named in the dense rows', e.g. ", nprobe 2048")
  dense_named = "".join(f", {key.rsplit('.', 1)[-1]} {value}" for key, _, value in
                        (item.partition("=") for item in args.reread_dense_set))
  for passages in args.reread_dense:
    dense = coded + ["index.sparse=False", f"index.reread={passages}", *args.reread_dense_set]
    rows[f"compact {args.codec}, dense, reread {passages}{dense_named}"] = (compact, folder, dense)
    if args.reread_dense_qsft:  # QSFT's encoders rank the candidates, the trained ones score
      rows[f"compact {args.codec}, dense, reread {passages}{dense_named}, QSFT candidates"] = (
          compact, folder, dense + ["eval.checkpoint=qsft", "index.reread_checkpoint=latest"])
  if args.versus:  # the same searches over another codec's index (evaluated and paired)
    other = f"compact:{args.versus}"
    other_folder = index_folder(other, threshold)
    for name, (spec, _, overrides) in list(rows.items()):
      if spec == compact:
        rows[name.replace(f"compact {args.codec}", f"compact {args.versus}", 1)] = (
            other, other_folder, [f"index.search_index={other_folder}",
                                  *overrides[1:]])
  return rows


def timed_rows(args, rows: dict) -> list[str]:
  """The rows timed: the hybrid searches, not those of `--versus`'s index."""
  return [name for name in rows if ", hybrid" in name
          and not (args.versus and name.startswith(f"compact {args.versus},"))]


def eval_file(args, overrides: list[str]) -> pathlib.Path:
  """The report `run.py eval` writes with these overrides (`dpjax.main.eval.report_file`)."""
  from dpjax.config import load_settings
  from dpjax.main.eval import report_file
  settings = load_settings(args.config, [*overrides, *args.set])
  return report_file(settings.eval, settings.index, pathlib.Path(args.workdir))


def build_and_evaluate(args, threshold, rows: dict) -> dict:
  """Each row's eval report and commands (the indexes built first where missing)."""
  from dpjax.index.faiss_index import index_folder
  workdir = pathlib.Path(args.workdir)
  dump = workdir / "dump"
  commands, out = {}, {}
  compact = [] if threshold is None else [f"index.filter_threshold={threshold}"]
  bm25 = (dump / "indexes" / "bm25" / "sparse_manifest.json").is_file()
  # The BM25 index, and its hybrid weights chosen for Flat, with Flat only: a compact build with
  # index.sparse would choose them again for index.search_index (Flat), replacing weights the
  # BM25 index records for a compact index.
  specs = [("Flat", ["index.sparse=True"], not bm25),
           (f"compact:{args.codec}", ["index.sparse=False", *compact], False)]
  if args.versus:
    specs.append((f"compact:{args.versus}", ["index.sparse=False", *compact], False))
  for spec, extra, missing in specs:
    folder = index_folder(spec, threshold if spec != "Flat" else None)
    if args.rerun or missing or not (dump / "indexes" / folder / "index_manifest.json").is_file():
      commands[f"index {spec}"] = run_py("index", args, [f"index.specs=['{spec}']", *extra])
  for name, (spec, folder, overrides) in rows.items():
    path = eval_file(args, overrides)
    if args.rerun or not path.is_file() or not _complete(path, args.questions):
      commands[f"eval {name}"] = run_py("eval", args, overrides)
    out[name] = json.loads(path.read_text())
  return {"reports": out, "commands": commands}


def _complete(path: pathlib.Path, questions: int) -> bool:
  """Whether an eval report holds per-question hits of all `questions` (not a limited run's)
  and, of a hybrid search, was scored with this code's BM25 (`sparse.SETTINGS`: a report of an
  earlier sentence term is run again, not reused)."""
  from dpjax.index.sparse import SETTINGS
  report = json.loads(path.read_text())
  hybrid = report.get("hybrid")
  return (report["questions"] == questions and (not hybrid or hybrid.get("bm25") == SETTINGS)
          and all(len(report.get("hits", {}).get(k, "")) == questions for k in PAIRED))


def served_bytes(dump: pathlib.Path, folder: str) -> dict:
  """Bytes per corpus token of everything a search over the compact index and the BM25 index
  reads: each file of the two index folders, and the dump's manifest."""
  from dpjax.index.manifest import read_manifest
  manifest = read_manifest(dump)  # (a dump filtered as it was made stores its kept tokens only)
  tokens = manifest.get("context_tokens", manifest["num_tokens"])
  parts = {}
  for name in (folder, "bm25"):
    base = dump / "indexes" / name
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
      parts[f"{name}/{path.relative_to(base)}"] = path.stat().st_size
  parts["dump manifest"] = (dump / "manifest.json").stat().st_size
  per_token = {k: v / tokens for k, v in parts.items()}
  return {"corpus_tokens": tokens, "bytes": parts, "per_token": per_token,
          "total_per_token": sum(per_token.values())}


def timed(args, rows: dict) -> dict:
  """Batch-1 latency and batch-64 throughput of each hybrid search, alternating the indexes."""
  import numpy as np

  from dpjax.config import load_settings
  from dpjax.data.questions import read_questions
  from dpjax.loading import data_paths
  from dpjax.main import open_searcher
  from dpjax.workdir import Workdir
  hybrid = {name: rows[name] for name in timed_rows(args, rows)}
  searchers, texts = {}, None
  for name, (_, folder, overrides) in hybrid.items():
    settings = load_settings(args.config, [*overrides, *args.set])
    workdir = Workdir(args.workdir)
    searchers[name] = open_searcher(settings, workdir, folder)[0]
    if texts is None:
      path = data_paths(settings.data, settings.index, workdir)["questions"]
      texts = [q.question for q in read_questions(path)]
      texts = [texts[i] for i in np.random.default_rng(TIMING_SEED).permutation(len(texts))]
    reread = searchers[name].index.reread
    if reread is not None:
      reread.cache_tokens = 0  # every timed passage encoded
  max_len = load_settings(args.config, args.set).eval.max_answer_length
  return time_searchers(searchers, texts, max_len, args.batch1, args.batches64)


def time_searchers(searchers: dict, texts: list[str], max_len: int, batch1: int,
                   batches64: int) -> dict:
  """{name: p50 / p90 milliseconds of a question searched alone, questions/s of the median full
  batch} of searchers warmed up on the first `texts`, then searching the next ones in turn."""
  from timing import time_searches
  for name, searcher in searchers.items():  # warm up: compiled shapes, caches, mapped pages
    searcher.compile(64)  # (every shape of the encoders' calls, as serve does at its start)
    searcher.search(texts[:64], k=10, max_answer_length=max_len)
    searcher.search(texts[:1], k=10, max_answer_length=max_len)
  # The questions after the warm-up's 64 (wrapping around a short file), each batch searched by
  # every searcher in turn.
  single = time_searches(searchers, texts, 1, batch1, first=64, wrap=True, k=10,
                         max_answer_length=max_len)
  batched = time_searches(searchers, texts, 64, batches64, first=64 + batch1,
                          wrap=True, k=10, max_answer_length=max_len)
  return {name: {"batch1_p50_ms": single[name]["p50_ms"], "batch1_p90_ms": single[name]["p90_ms"],
                 "batch1_questions": single[name]["questions"],
                 "batch64_questions_per_s": batched[name]["questions_per_s_median_batch"],
                 "batch64_batches": batched[name]["batches"]} for name in searchers}


def reused_timing(out: pathlib.Path, rows: list[str]) -> dict:
  """The timing of `out`'s section (`--reuse-timing`: notes or rows re-rendered without
  timing again), refused unless it timed these rows' hybrid searches."""
  earlier = json.loads(out.read_text()).get("squad_open", {}) if out.is_file() else {}
  speed = earlier.get("speed") or {}
  wanted = set(rows)
  if set(speed.get("rows", {})) != wanted:
    raise SystemExit(f"{out}: no timing of {sorted(wanted)} to reuse; time them (drop "
                     "--reuse-timing)")
  return speed


def summarise(args, threshold, evaluated: dict, speed: dict, rows: dict) -> dict:
  from dpjax import metrics
  reports = evaluated["reports"]
  table = {}
  for name, report in reports.items():
    table[name] = {**{k: report[k] for k in KEYS if k in report},
                   "index_tokens": report["index_tokens"],
                   "checkpoint": report.get("checkpoint", "latest"),
                   "model_step": report["model_step"],
                   "questions_per_s_eval": report["questions"] / report["search_seconds"],
                   "questions_per_sec_batch64_eval": report["questions_per_sec_batch64"],
                   "hybrid": report.get("hybrid") and {
                       k: report["hybrid"][k] for k in ("weight", "sentence_weight", "passages")},
                   "reread": report.get("reread", 0),
                   "reread_margin": report.get("reread_margin"),
                   "reread_window": report.get("reread_window"),
                   "reread_scored_by": report.get("reread_scored_by"),
                   "nprobe": report.get("nprobe")}
  paired = {}
  for name in reports:
    if name.startswith(f"compact {args.codec},"):
      versus = [name.replace(f"compact {args.codec}", f"compact {args.versus}", 1)
                ] if args.versus else []
      for other in ["Flat, " + name.split(", ")[1], *versus]:
        paired[f"{name} vs {other}"] = {
            k: metrics.mcnemar_p(reports[name]["hits"][k], reports[other]["hits"][k])
            for k in PAIRED}
  folder = next(f for s, f, _ in rows.values() if s != "Flat")
  served = served_bytes(pathlib.Path(args.workdir) / "dump", folder)
  return {"commit": git_commit(), "config": args.config, "workdir": str(args.workdir),
          "codec": args.codec, "filter_threshold": threshold, "compact_set": args.compact_set,
          "questions": next(iter(reports.values()))["questions"],
          "model_step": next(iter(reports.values()))["model_step"], "rows": table,
          "paired": paired, "speed": speed, "served_bytes": served,
          "bytes_budget": BYTES_BUDGET, "commands": evaluated["commands"],
          "notes": args.note}


def _count_and_margin(text: str) -> tuple[int, float]:
  """`--reread-margin`'s "R:M" -> (R, M)."""
  count, sep, margin = text.partition(":")
  try:
    return int(count), float(margin)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected R:M, e.g. 3:2.5") from None


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--codec", default="OPQ24,PQ24", help="the compact index's faiss codec")
  parser.add_argument("--threshold", default="filter",
                      help="filter threshold: a number, none, or filter (run.py filter's)")
  parser.add_argument("--set", action="append", default=[], help="for every run.py")
  parser.add_argument("--compact-set", action="append", default=[],
                      help="for the compact index's evals and searcher only (e.g. "
                           "eval.checkpoint=qsft)")
  parser.add_argument("--reread", action="append", type=int, default=[],
                      help="a compact hybrid row re-reading this many top passages")
  parser.add_argument("--reread-dense", action="append", type=int, default=[],
                      help="a compact dense row re-reading this many top passages (not timed)")
  parser.add_argument("--reread-margin", action="append", type=_count_and_margin, default=[],
                      metavar="R:M", help="a compact hybrid row re-reading at most R passages, "
                      "those holding a span within M of the best")
  parser.add_argument("--reread-set", action="append", default=[],
                      help="for the re-reading rows only")
  parser.add_argument("--reread-dense-set", action="append", default=[],
                      help="for the dense re-reading rows only, named in them (e.g. "
                           "index.nprobe=2048: more passages visited for its candidates)")
  parser.add_argument("--reread-dense-qsft", action="store_true",
                      help="each dense re-reading row again with QSFT's question encoders "
                           "ranking the candidates and the trained ones scoring the re-read "
                           "spans (eval.checkpoint=qsft, index.reread_checkpoint=latest)")
  parser.add_argument("--window", type=int, default=None,
                      help="the hybrid re-reading rows read this many word pieces around a "
                           "passage's best span (index.reread_window)")
  parser.add_argument("--versus", default="",
                      help="another compact codec: its index's rows beside --codec's, each "
                      "--codec row paired with its row too (evaluated, not timed)")
  parser.add_argument("--rerun", action="store_true")
  parser.add_argument("--questions", type=int, default=10570,
                      help="the evaluation questions an eval report must hold to be reused")
  parser.add_argument("--batch1", type=int, default=200, help="questions timed one at a time")
  parser.add_argument("--batches64", type=int, default=8, help="batches of 64 timed")
  parser.add_argument("--no-timing", dest="timing", action="store_false")
  parser.add_argument("--reuse-timing", action="store_true",
                      help="keep --out's timing of the same searches (its commit recorded)")
  parser.add_argument("--out", default="results/scale.json")
  parser.add_argument("--note", action="append", default=[])
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  from dpjax.config import setup_logging
  from dpjax.distributed import enable_compilation_cache
  setup_logging(fmt="%(asctime)s %(name)s: %(message)s")
  enable_compilation_cache()  # (as run.py: what its evals compiled is loaded, not compiled)
  threshold = threshold_of(args)
  rows = systems(args, threshold)
  evaluated = build_and_evaluate(args, threshold, rows)
  out = pathlib.Path(args.out)
  speed = reused_timing(out, timed_rows(args, rows)) if args.reuse_timing else (
      {"commit": git_commit(), "rows": timed(args, rows)} if args.timing else {})
  section = summarise(args, threshold, evaluated, speed, rows)
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  section["command"] = command_line("experiments/benchmarks/compact_squad.py", argv)
  import scale
  from dpjax.io import write_json, write_text_atomic
  results = json.loads(out.read_text()) if out.is_file() else {}
  results["squad_open"] = section
  write_json(out, results)
  write_text_atomic(out.with_suffix(".md"), scale.render_all(results))
  print(out.with_suffix(".md").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
