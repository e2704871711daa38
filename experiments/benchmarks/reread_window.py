"""Chooses `index.reread_window` on training questions, then times it and evaluates it on every
dev question: hybrid search re-reading up to R passages (the settings' `index.reread`, with
their `index.reread_margin`), whole passages against windows of W word pieces around each
passage's best span.

  taskset -c 1 python experiments/benchmarks/reread_window.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --set index.sparse=True --set index.search_index=FOLDER \\
      --set index.reread=3 --set index.reread_margin=3 --set index.sparse_weight=1 \\
      --set index.sparse_sentence_weight=0.5 --flat-set index.sparse=True ... \\
      --out results/reread_window.json

1. The choice: on the questions hybrid weights are chosen on (`hybrid_weights.tune_questions`),
   per window of the grid and for whole passages, from an empty cache in batches of 64: EM@1,
   passage Top-1, passages and tokens encoded per question, seconds. The smallest window whose
   EM@1 and Top-1 are both within `--tolerance` points of whole passages is chosen.
2. The dev questions (`--dev`): `run.py eval` of whole passages, of the chosen window and of
   the Flat hybrid search (`--flat-set`), each kept where
   its report holds every question; McNemar's exact test pairs the window with the other two.
   The Flat search's settings are --flat-set's alone (not --set's); without them, no Flat row.
3. The timing (`--time`): one process, the searchers alternating batch by batch over a seeded
   shuffle of the dev questions (as results/scale.md's timing): batch 1 (p50 / p90 ms) and batch
   64 (questions/s of the median batch), question encoding included, re-reading's cache off.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "benchmarks"))
from experiments.report import command_line, elide_notes, git_commit  # noqa: E402
from reread_margin import measure  # noqa: E402

WINDOWS = (128, 96, 64, 48, 32)
PAIRED = ("em@1", "top1", "top20")


def choose(args, settings, workdir) -> dict:
  """Part 1: the rows of the window grid on the training questions, and the choice."""
  from dpjax.index.hybrid_weights import tune_questions
  from dpjax.main import open_searcher
  searcher = open_searcher(settings, workdir)[0]
  questions, path = tune_questions(settings.data, settings.index, workdir)
  length = settings.eval.max_answer_length
  margin = settings.index.reread_margin
  rows = [measure(searcher, questions, margin, length, window=None)]
  rows += [measure(searcher, questions, margin, length, window=w)
           for w in sorted(args.window or WINDOWS)]
  whole = rows[0]
  close = [r for r in rows[1:] if whole["em@1"] - r["em@1"] <= args.tolerance
           and whole["top1"] - r["top1"] <= args.tolerance]
  return {"questions": len(questions), "questions_file": path, "tolerance": args.tolerance,
          "rows": rows, "chosen": min((r["window"] for r in close), default=None)}


def run_eval(args, overrides: list[str]) -> tuple[dict, str | None]:
  """The eval report of these overrides, `run.py eval` run where it is missing or holds fewer
  than every question; (report, the command run or None)."""
  from dpjax.config import load_settings
  from dpjax.main.eval import report_file
  settings = load_settings(args.config, overrides)
  path = report_file(settings.eval, settings.index, pathlib.Path(args.workdir))
  command = None
  if not path.is_file() or not _complete(json.loads(path.read_text()), args.questions):
    argv = [sys.executable, "run.py", "eval", "--config", args.config, "--workdir", args.workdir]
    for value in overrides:
      argv += ["--set", value]
    subprocess.run(argv, cwd=REPO, check=True)
    command = shlex.join(["python", *argv[1:]])
  return json.loads(path.read_text()), command


def _complete(report: dict, questions: int) -> bool:
  return report["questions"] == questions and all(
      len(report.get("hits", {}).get(k, "")) == questions for k in PAIRED)


def dev(args, window: int) -> dict:
  """Part 2: every dev question's eval of whole passages, the window and Flat; paired."""
  from dpjax import metrics
  keys = ("em@1", "em@10", "top1", "top5", "top20", "mrr@20")
  runs = {"whole passages": args.set, f"window {window}": [*args.set,
                                                          f"index.reread_window={window}"]}
  if args.flat_set:
    runs["Flat"] = args.flat_set
  reports, commands = {}, {}
  for name, overrides in runs.items():
    reports[name], command = run_eval(args, overrides)
    if command:
      commands[name] = command
  ours = reports[f"window {window}"]
  return {"rows": {name: {**{k: r[k] for k in keys}, "index": r["index"],
                          "model_step": r["model_step"], "reread": r.get("reread", 0),
                          "reread_margin": r.get("reread_margin"),
                          "reread_window": r.get("reread_window"),
                          "hybrid": r.get("hybrid") and {k: r["hybrid"][k] for k in (
                              "weight", "sentence_weight", "passages")}}
                   for name, r in reports.items()},
          "paired": {f"window {window} vs {name}": {
              k: metrics.mcnemar_p(ours["hits"][k], reports[name]["hits"][k]) for k in PAIRED}
              for name in runs if name != f"window {window}"},
          "commands": commands}


def timed(args, settings, workdir, window: int) -> dict:
  """Part 3: batch 1 and batch 64 of whole passages, the window and Flat, alternating."""
  import numpy as np
  from compact_squad import TIMING_SEED, time_searchers

  from dpjax.config import load_settings
  from dpjax.data.questions import read_questions
  from dpjax.loading import data_paths
  from dpjax.main import open_searcher
  searchers = {"whole passages": open_searcher(settings, workdir)[0],
               f"window {window}": open_searcher(settings, workdir)[0]}
  if args.flat_set:
    searchers["Flat"] = open_searcher(load_settings(args.config, args.flat_set), workdir)[0]
  searchers[f"window {window}"].index.reread.window = window
  for searcher in searchers.values():
    if searcher.index.reread is not None:
      searcher.index.reread.cache_tokens = 0  # every timed passage encoded
  texts = [q.question for q in read_questions(
      data_paths(settings.data, settings.index, workdir)["questions"])]
  texts = [texts[i] for i in np.random.default_rng(TIMING_SEED).permutation(len(texts))]
  return time_searchers(searchers, texts, settings.eval.max_answer_length, args.batch1,
                        args.batches64)


def render(out: dict) -> str:
  """The Markdown of a study's JSON."""
  lines = ["# Re-reading around the best span (experiments/benchmarks/reread_window.py)", "",
           f"Written by `{out['command']}` at {out['commit']}.", ""]
  part = out.get("choice")
  if part:
    lines += [f"Training questions ({part['questions']}, {part['questions_file']}), batches of "
              "64 from an empty cache:", "",
              "| window | EM@1 | Top-1 | passages / question | tokens / question | seconds |",
              "|---|---|---|---|---|---|"]
    for r in part["rows"]:
      lines.append(f"| {r['window'] or 'whole passages'} | {r['em@1']:.2f} | {r['top1']:.2f} | "
                   f"{r['passages_per_question']:.2f} | {r['tokens_per_question']:.1f} | "
                   f"{r['seconds']:.1f} |")
    lines += ["", f"Chosen (the smallest window within {part['tolerance']} of whole passages' "
              f"EM@1 and Top-1): {part['chosen']}.", ""]
  if out.get("dev"):
    lines += ["Every dev question:", "", "| search | EM@1 | EM@10 | Top-1 | Top-5 | Top-20 | "
              "MRR@20 |", "|---|---|---|---|---|---|---|"]
    for name, r in out["dev"]["rows"].items():
      lines.append(f"| {name} | " + " | ".join(f"{r[k]:.2f}" for k in (
          "em@1", "em@10", "top1", "top5", "top20", "mrr@20")) + " |")
    lines += ["", "McNemar's exact test (questions right only in the first / only in the "
              "second, two-sided p):", ""]
    for name, pair in out["dev"]["paired"].items():
      lines.append(f"- {name}: " + "; ".join(
          f"{k} {first} / {second}, p = {p:.3g}" for k, (first, second, p) in pair.items()))
    lines.append("")
  if out.get("speed"):
    lines += [f"Timing at {out['speed']['commit']} (one process, alternating):", "",
              "| search | p50 ms batch 1 | p90 ms batch 1 | q/s batch 64 (median batch) |",
              "|---|---|---|---|"]
    for name, r in out["speed"]["rows"].items():
      lines.append(f"| {name} | {r['batch1_p50_ms']:.1f} | {r['batch1_p90_ms']:.1f} | "
                   f"{r['batch64_questions_per_s']:.1f} |")
    lines.append("")
  lines += [note for note in out.get("notes", [])]
  return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--flat-set", action="append", default=[],
                      help="the Flat hybrid search's settings (instead of --set's)")
  parser.add_argument("--window", action="append", type=int, default=[])
  parser.add_argument("--tolerance", type=float, default=0.5)
  parser.add_argument("--dev", action="store_true", help="evaluate every dev question")
  parser.add_argument("--time", action="store_true", help="time the searches")
  parser.add_argument("--use-window", type=int, default=None,
                      help="evaluate or time this window, not the chosen one")
  parser.add_argument("--skip-choice", action="store_true",
                      help="no training-question rows (with --use-window)")
  parser.add_argument("--questions", type=int, default=10570)
  parser.add_argument("--batch1", type=int, default=200)
  parser.add_argument("--batches64", type=int, default=8)
  parser.add_argument("--out", default="results/reread_window.json")
  parser.add_argument("--note", action="append", default=[])
  args = parser.parse_args(argv)
  from dpjax.config import load_settings, setup_logging
  from dpjax.distributed import enable_compilation_cache
  from dpjax.io import write_json, write_text_atomic
  from dpjax.workdir import Workdir
  setup_logging()
  enable_compilation_cache()
  settings = load_settings(args.config, args.set)
  if args.skip_choice and not args.use_window:
    raise SystemExit("--skip-choice needs --use-window (the window evaluated or timed)")
  if not settings.index.reread or settings.index.reread_window is not None:
    raise SystemExit("set index.reread (> 0) and no index.reread_window: the windows are this "
                     "study's")
  workdir = Workdir(args.workdir)
  out = {"commit": git_commit(), "command": command_line(
      "experiments/benchmarks/reread_window.py",
      elide_notes(sys.argv[1:] if argv is None else argv)), "notes": args.note}
  if not args.skip_choice:
    out["choice"] = choose(args, settings, workdir)
  window = args.use_window or (out.get("choice") or {}).get("chosen")
  if window is not None and args.dev:
    out["dev"] = dev(args, window)
  if window is not None and args.time:
    out["speed"] = {"commit": git_commit(), "rows": timed(args, settings, workdir, window)}
  path = pathlib.Path(args.out)
  write_json(path, out)
  write_text_atomic(path.with_suffix(".md"), render(out))
  print(path.with_suffix(".md").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
