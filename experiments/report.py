"""Report helpers of the experiment scripts: results JSON + Markdown naming the command."""
from __future__ import annotations

import pathlib
import shlex
import subprocess
import sys
from typing import Sequence

from dpjax.io import write_json, write_text_atomic
from dpjax.metrics import mcnemar_p  # noqa: F401 (the experiments' paired test, from here)


ROOT = pathlib.Path(__file__).resolve().parents[1]


def git_commit() -> str:
  """HEAD's commit, with `-dirty` when tracked files differ from it."""
  run = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
  commit = run("rev-parse", "HEAD").stdout.strip() or "unknown"
  return commit + ("-dirty" if run("diff", "--quiet", "HEAD").returncode == 1 else "")


class Elided(str):
  """A `--flag ...` placeholder of elide_notes: printed as is, never shell-quoted."""


def command_line(script: str, argv: Sequence[str]) -> str:
  """`python SCRIPT ARGS` as a shell can run it (arguments quoted; elided notes shown as is)."""
  return " ".join(["python", script,
                   *(a if isinstance(a, Elided) else shlex.quote(a) for a in argv)])


def elide_notes(argv: Sequence[str], flags=("--note",)) -> list[str]:
  """A command line with the values of note flags (prose printed in the report) shown as `...`."""
  shown, rest = [], list(argv)
  while rest:
    arg = rest.pop(0)
    if arg in flags:
      if rest:
        rest.pop(0)
      if f"{arg} ..." not in shown:
        shown.append(Elided(f"{arg} ..."))
    else:
      shown.append(arg)
  return shown


def with_notes(lines: Sequence[str], notes: Sequence[str]) -> str:
  """A report's markdown: its lines, then each note (`--note`) as its own paragraph."""
  return "\n".join([*lines, *(part for note in notes for part in ("", note))]) + "\n"


def save_results(out, results: dict, render, script: str, argv=None) -> "pathlib.Path":
  """Writes `results` as JSON to `out` and `render(results, command)` as Markdown beside it
  (`command`: how the script was run); prints the Markdown; returns the JSON path."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  write_json(out, results)
  command = command_line(script, sys.argv[1:] if argv is None else argv)
  write_text_atomic(out.with_suffix(".md"), render(results, command))
  print(out.with_suffix(".md").read_text())
  return out


def p_text(p: float | None) -> str:
  """A p-value to 3 significant digits; one below the smallest double reads `< 1e-300`."""
  if p is None:
    return "-"
  return "< 1e-300" if p == 0 else f"{p:.3g}"


GPU_ROWS = (("teacher's RC EM", "teacher_rc_exact_match"), ("RC EM", "rc_exact_match"),
            ("RC F1", "rc_f1"), ("open EM@1", "em@1"),
            ("open EM@10", "em@10"), ("passage Top-1", "top1"), ("passage Top-5", "top5"),
            ("passage Top-20", "top20"), ("MRR@20", "mrr@20"), ("training steps", "steps"),
            ("training's median step (ms)", "train_step_ms_median"),
            ("XLA autotuning results cached at the start (fusions)", "autotuned_at_start"),
            ("training's compiles", "train_compiles"),
            ("training: step shapes compiled ahead", "train_compiled_ahead"),
            ("training: RC eval call shapes compiled with them", "train_rc_compiled_ahead"),
            ("dump: stored tokens/s after compiles", "stored_tokens_per_s"),
            ("eval: questions/s over its search", "questions_per_s"),
            ("eval: run alongside the hybrid search", "eval_alongside_hybrid"),
            ("hybrid EM@1", "hybrid_em@1"), ("hybrid EM@10", "hybrid_em@10"),
            ("hybrid passage Top-1", "hybrid_top1"), ("hybrid passage Top-20", "hybrid_top20"),
            ("hybrid eval: questions/s over its search", "hybrid_questions_per_s"))


def cell(value) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:g}"
  return str(value)


# The timing stages of the FLOPs table: (label, the stage's figures' prefix, what its seconds are).
FLOPS_ROWS = (("training", "train", "its data and steps seconds"),
              ("dump, cold", "dump_cold", "the process's wall"),
              ("dump", "dump", "its encoding seconds"),
              ("dump, warm", "dump_warm", "its encoding seconds"),
              ("eval (question encoding)", "eval", "its search seconds"),
              ("hybrid eval (question encoding)", "hybrid_eval", "its search seconds"),
              ("bf16 step, XLA attention", "step", "the median step"),
              ("bf16 step, Pallas attention", "step_pallas", "the median step"))


def _candidate_figures(results: dict, name: str) -> dict:
  """A candidate's figures of GPU_ROWS, from its records and the run's."""
  c = results["candidates"][name]
  return {**c.get("teacher", {}), **c.get("train", {}), **c.get("dump", {}), **c.get("open", {}),
          **{f"hybrid_{k}": v for k, v in c.get("hybrid", {}).items()},
          # (a run before the flag ran its eval alone)
          "eval_alongside_hybrid": c.get("eval_alongside_hybrid", False if "open" in c else None),
          "autotuned_at_start": results.get("autotuned_at_start")}


def _wall_split(results: dict, name: str) -> str:
  """'data / compiles / steps / RC eval (sum of wall)' seconds of a candidate's training."""
  train = results["candidates"][name].get("train", {})
  wall = results["stages"].get(f"{name}.train", {}).get("wall_s")
  parts = [train.get(f"train_{part}_s") for part in ("data", "compiles", "steps", "rc_eval")]
  if None in parts:
    return f"- (wall {cell(wall)})"
  return " / ".join(map(cell, parts)) + f" ({cell(sum(parts))} of {cell(wall)})"


def _search_split(found: dict, prefix: str = "") -> str:
  """'encode wait / hits / units / scoring (compiles: n, s)' seconds of an eval's search
  (`dpjax.main.eval._answered`), '-' for a run before the split was recorded."""
  split = found.get(f"{prefix}search_split")
  if not split:
    return "-"
  parts = " / ".join(cell(split.get(f"{part}_seconds"))
                     for part in ("encode_wait", "hits", "units", "scoring"))
  return (f"{parts} of {cell(found.get(f'{prefix}search_seconds'))} (compiles: "
          f"{split.get('compiles')}, {cell(split.get('compile_seconds'))})")


def _dump_split(dump: dict | None) -> str:
  """'encoder wait / compiles / host (pipeline wait [writes' drain], dispatch, fetch) of
  seconds' of a dump (its manifest's `dpjax.index.dump._host_times`), '-' for a run before they
  were carried."""
  if not dump or dump.get("encoder_wait_seconds") is None:
    return "-"
  compiles = (dump.get("compile_ahead_seconds") or 0.0) + max(
      (dump.get("seconds") or 0.0) - dump["encoder_wait_seconds"] - dump["host_seconds"]
      - (dump.get("compile_ahead_seconds") or 0.0), 0.0)
  return (f"{cell(dump['encoder_wait_seconds'])} / {cell(compiles)} / "
          f"{cell(dump['host_seconds'])} ({cell(dump.get('pipeline_wait_seconds'))} "
          f"[{cell(dump.get('write_wait_seconds'))}], "
          f"{cell(dump.get('dispatch_seconds'))}, {cell(dump.get('fetch_seconds'))}) of "
          f"{cell(dump.get('seconds'))}")


def _step_times(step: dict | None) -> str:
  """'median / back to back / host (arrays, packed)' ms of `train_step.py`'s step, '-' without
  one; the arrays and packing '-' for a run before they were recorded."""
  if not step:
    return "-"
  ms = lambda key: cell(1e3 * step[key]) if step.get(key) is not None else "-"
  return (f"{ms('median_step_s')} / {ms('pipelined_step_s')} / {ms('host_step_s')} "
          f"({cell(step.get('step_arrays'))}, {cell(step.get('packed'))})")


def _slowest(train: dict) -> str:
  """'name: compiles, seconds; ...' of a training's slowest compiles (its timing record's)."""
  slowest = train.get("train_slowest_compiles") or {}
  return "; ".join(f"`{name}`: {c['compiles']}, {cell(float(c['seconds']))}"
                   for name, c in slowest.items()) or "-"


def _flops_table(results: dict) -> list[str]:
  """The default candidate's model FLOPs, FLOP/s and MFU by timing stage (docs/performance.md)."""
  figures, peak = results["figures"], results.get("peak") or {}
  rows = [(label, prefix, basis) for label, prefix, basis in FLOPS_ROWS
          if figures.get(f"{prefix}_flops")]
  if not rows:
    return []
  if peak.get("per_device"):
    against = f"{peak['per_device'] / 1e12:g} TFLOP/s bf16 a device x {peak['devices']}"
  else:
    against = peak.get("note", "no peak known: MFU not computed")
  lines = ["", f"Model FLOPs and MFU (the default; peak: {against}; docs/performance.md):", "",
           "| stage | model FLOPs | over | TFLOP/s | MFU |", "|---|---|---|---|---|"]
  for label, prefix, basis in rows:
    share = figures.get(f"{prefix}_mfu")
    lines.append(f"| {label} | {figures[f'{prefix}_flops']:.3g} | {basis} | "
                 f"{figures[f'{prefix}_flops_per_s'] / 1e12:.3g} | "
                 + ("-" if share is None else f"{100 * share:.1f}%") + " |")
  return lines


def render_gpu_check(results: dict, command: str) -> str:
  """results/gpu_check.md: the device, the parts' commands, each candidate's recipe and
  figures, the issue's targets (met, missed or not measured) and each stage's wall time."""
  names = list(results["candidates"])
  lines = ["# Full-scale check on a GPU (experiments/gpu_check.py)", "",
           f"Device: {results['device']}. Rendered by `{command}`.", "", "Commands (in order):", ""]
  lines += [f"- `{p['command']}` at {p['commit'][:10]} ({p['elapsed_s']} s)"
            for p in results.get("parts", [results])]
  recipe_keys = list(results["candidates"]["default"]["recipe"])
  lines += ["", "| setting | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  lines += [f"| {k} | " + " | ".join(cell(results["candidates"][n]["recipe"].get(k))
                                     for n in names) + " |" for k in recipe_keys]
  lines += ["", "| figure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  found = {n: _candidate_figures(results, n) for n in names}
  distilled = any("teacher" in results["candidates"][n] for n in names)
  for label, key in GPU_ROWS:
    if key.startswith("teacher_") and not distilled:
      continue
    lines.append(f"| {label} | " + " | ".join(cell(found[n].get(key)) for n in names) + " |")
  lines.append("| training's wall (s): data / compiles / steps / RC eval (their sum of the wall) | "
               + " | ".join(_wall_split(results, n) for n in names) + " |")
  for label, prefix in (("eval", ""), ("hybrid eval", "hybrid_")):
    lines.append(f"| {label}'s search (s): encode wait / index search / searches given its hits "
                 "/ scoring of the search's seconds (compiles within them) | "
                 + " | ".join(_search_split(found[n], prefix) for n in names) + " |")
  warm = results.get("speed", {}).get("dump_warm")
  for label, dumps in (("dump", [results["candidates"][n].get("dump") for n in names]),
                       ("warm dump", [warm if n == "default" else None for n in names])):
    lines.append(f"| {label}'s seconds: encoder wait / compiles / host (of it: pipeline wait "
                 "[of that, the writes' drain], dispatch, fetch) of its seconds | "
                 + " | ".join(map(_dump_split, dumps)) + " |")
  for label, key in (("XLA", "step"), ("Pallas", "step_pallas")):
    step = results.get("speed", {}).get(key)
    lines.append(f"| bf16 step, {label} attention (ms): a step / back to back / its call's host "
                 "time (arrays passed, packed) | "
                 + " | ".join(_step_times(step if n == "default" else None) for n in names) + " |")
  lines.append("| training's slowest compiles (function: compiles, s) | " + " | ".join(
      _slowest(results["candidates"][n].get("train", {})) for n in names) + " |")
  lines.append("| training's other parts (s): setup / checkpoints / validation | " + " | ".join(
      " / ".join(cell(results["candidates"][n].get("train", {}).get(f"train_{part}_s"))
                 for part in ("setup", "checkpoint", "validation")) for n in names) + " |")
  lines += ["", "Targets (the default candidate):", "", "| figure | target | value | met |",
            "|---|---|---|---|"]
  met = {True: "yes", False: "**no**", None: "not measured"}
  lines += [f"| {t['figure']} | {t['target']} | {cell(t['value'])} | {met[t['met']]} |"
            for t in results["targets"]]
  lines += _flops_table(results)
  lines += ["", "Stages (wall seconds, exit status):", "", "| stage | wall s | rc |",
            "|---|---|---|"]
  lines += [f"| {k} | {cell(v.get('wall_s'))} | {v['rc']} |" for k, v in results["stages"].items()]
  return with_notes(lines, results.get("notes", []))


def gpu_check_report(argv: Sequence[str]) -> int:
  """`report.py gpu_check PART.json [...] [--note TEXT]`: merges a check run in parts into
  results/gpu_check.{json,md} and appends it to results/gpu_runs.jsonl (once)."""
  import argparse
  import json
  parser = argparse.ArgumentParser(prog="report.py gpu_check")
  parser.add_argument("parts", nargs="+", help="gpu_check.json of each command, in order")
  parser.add_argument("--out", default="results/gpu_check.json")
  parser.add_argument("--history", default="results/gpu_runs.jsonl")
  parser.add_argument("--note", action="append", default=[])
  args = parser.parse_args(argv)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  from gpu_check import merge
  results = merge([json.loads(pathlib.Path(p).read_text()) for p in args.parts])
  results["notes"] = args.note
  save_results(args.out, results, render_gpu_check, "experiments/report.py",
               ["gpu_check", *elide_notes(argv)])
  history = pathlib.Path(args.history)
  key = [p["command"] for p in results["parts"]], results["parts"][0]["commit"]
  seen = [json.loads(x) for x in history.read_text().splitlines()] if history.is_file() else []
  if not any((r["commands"], r["commit"]) == key for r in seen):
    run = {"commands": key[0], "commit": key[1], "device": results["device"],
           "recipe": results["candidates"]["default"]["recipe"], "figures": results["figures"],
           "candidates": {n: {**c.get("train", {}), **c.get("open", {}),
                              **{f"hybrid_{k}": v for k, v in c.get("hybrid", {}).items()}}
                          for n, c in results["candidates"].items()}}
    with history.open("a") as f:
      f.write(json.dumps(run) + "\n")
  return 0


if __name__ == "__main__":
  if sys.argv[1:2] != ["gpu_check"]:
    sys.exit("usage: python experiments/report.py gpu_check PART.json [...] [--note TEXT]")
  sys.exit(gpu_check_report(sys.argv[2:]))
