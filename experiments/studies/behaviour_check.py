"""Behaviour unchanged between two commits: `make demo`'s chain at each, compared bit for bit.

  python experiments/studies/behaviour_check.py                      # c98f25e against HEAD
  python experiments/studies/behaviour_check.py --old c98f25e --new HEAD \\
      --out results/behaviour_check.json

Each commit is checked out into a git worktree in a temporary folder and runs, from that tree
with this interpreter, what `make demo` runs: `run.py train`, `dump`, `index` and `eval` with
`--config experiments/demo.py`, into a workdir of its own, plus `--set train.log_every=1` (every
step's loss logged; logging reads the metrics, it does not change the step) and
`--set train.progress_bar=False`; `--set` adds overrides to both (e.g. `train.num_steps=100`).
The two chains run side by side, each pinned to one core (`--cores 0 1`), or one after the
other (`--sequential`). Compared, each as its file wrote it:
- metrics.jsonl: the loss of each of the first `--compare-steps` training steps, and the other
  figures of those lines (gradient norm, learning rate, start accuracy; throughput dropped);
- results.json and rc_predictions.json: the dev RC figures and every dev question's answer;
- open_eval_Flat.json: the open-domain figures (timings dropped);
- open_predictions_Flat.jsonl: every question's ranked answers, scores and passages.
A JSON figure file is identical when every figure of the old commit's is the new's; figures only
the new writes are listed beside the verdict. `--set-new` holds a setting the new commit added at
the old behaviour (the old commit would refuse it), and `--rename-new` names the files it then
writes under other names. Writes `--out` (JSON: the commits, the
command, each comparison's verdict and first difference) and its Markdown twin; exits 1 if
anything differs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.report import command_line, save_results, with_notes  # noqa: E402

SCRIPT = "experiments/studies/behaviour_check.py"
MODES = ("train", "dump", "index", "eval")
# Keys of a figure that measure time or speed: they differ from run to run by nature.
TIMING_ENDS = ("_s", "_ms", "_sec", "_per_s", "_per_sec", "_seconds")
TIMING_WORDS = ("seconds", "time", "wall", "elapsed", "latency", "per_sec", "_per_s_")


def git(*args: str, cwd=REPO) -> str:
  return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                        text=True).stdout.strip()


def run_chain(tree: pathlib.Path, workdir: pathlib.Path, config: str, settings: list[str],
              core: int | None) -> subprocess.Popen:
  """`make demo`'s four commands at `tree`, one after the other, as one background process."""
  pin = f"taskset -c {core} " if core is not None else ""
  steps = [f"{pin}{sys.executable} run.py {mode} --config {config} --workdir {workdir} "
           + " ".join(settings) for mode in MODES]
  script = "set -e\n" + "\n".join(f"echo '=== {s}'\n{s}" for s in steps)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tree's own dpjax
  with open(workdir.parent / f"{workdir.name}.log", "w") as log:
    return subprocess.Popen(["bash", "-c", script], cwd=tree, stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def _no_timings(value):
  """A figure with its timing keys dropped, recursively."""
  if isinstance(value, dict):
    return {k: _no_timings(v) for k, v in value.items()
            if not (k.lower().endswith(TIMING_ENDS) or any(w in k.lower() for w in TIMING_WORDS))}
  if isinstance(value, list):
    return [_no_timings(v) for v in value]
  return value


def _train_lines(workdir: pathlib.Path, last_step: int) -> list[dict]:
  lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [line for line in lines if line.get("split") == "train" and "loss" in line
          and line["step"] <= last_step]


def compare(old, new) -> dict:
  """{"verdict": "identical" | "different", "compared": N, "first_difference": ...}."""
  if old == new:
    return {"verdict": "identical", "compared": len(old) if isinstance(old, (list, dict)) else 1}
  if isinstance(old, list) and isinstance(new, list):
    index = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    return {"verdict": "different", "compared": max(len(old), len(new)),
            "first_difference": {"index": index, "old": old[index] if index < len(old) else None,
                                 "new": new[index] if index < len(new) else None}}
  if isinstance(old, dict) and isinstance(new, dict):
    added = sorted(set(new) - set(old))
    if added and {k: new[k] for k in old} == old:  # the old figures, and new ones beside them
      return {"verdict": "identical", "compared": len(old), "added_by_new": added}
    key = next(k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
    return {"verdict": "different", "compared": len(set(old) | set(new)),
            "first_difference": {"key": key, "old": old.get(key), "new": new.get(key)}}
  return {"verdict": "different", "compared": 1, "first_difference": {"old": old, "new": new}}


def readers(last_step: int, renamed: dict | None = None) -> dict:
  """What is compared: a name -> a function of a workdir (and of its side) returning the values
  to compare; `renamed` maps a file name to the name the new commit writes it under."""
  def losses(w):
    return [[line["step"], line["loss"]] for line in _train_lines(w, last_step)]

  def other_train(w):
    return [_no_timings({k: v for k, v in line.items() if k != "loss"})
            for line in _train_lines(w, last_step)]

  def path(w, name):
    return w / (renamed or {}).get(name, name) if w.name.endswith("_new") else w / name

  def jsonl(name):
    return lambda w: [_no_timings(json.loads(line))
                      for line in path(w, name).read_text().splitlines() if line.strip()]

  def json_file(name):
    return lambda w: _no_timings(json.loads(path(w, name).read_text()))

  return {f"metrics.jsonl: loss of steps 1-{last_step}": losses,
          f"metrics.jsonl: other figures of steps 1-{last_step}": other_train,
          "results.json (dev RC figures)": json_file("results.json"),
          "rc_predictions.json (dev RC answers)": json_file("rc_predictions.json"),
          "open_eval_Flat.json (open-domain figures)": json_file("open_eval_Flat.json"),
          "open_predictions_Flat.jsonl (answers)": jsonl("open_predictions_Flat.jsonl")}


def _read(read, workdir: pathlib.Path):
  try:
    return read(workdir)
  except FileNotFoundError as error:  # a file one commit writes and the other does not
    return f"missing: {pathlib.Path(error.filename).name}"


def check(args, scratch: pathlib.Path) -> dict:
  commits = {side: git("rev-parse", ref) for side, ref in (("old", args.old), ("new", args.new))}
  settings = ["--set", "train.log_every=1", "--set", "train.progress_bar=False"]
  settings += [word for s in args.set for word in ("--set", s)]
  new_only = [word for s in args.set_new for word in ("--set", s)]
  trees, runs, start = {}, {}, time.time()
  for i, (side, commit) in enumerate(commits.items()):
    trees[side] = scratch / f"tree_{side}"
    git("worktree", "add", "--detach", str(trees[side]), commit)
    imported = subprocess.run([sys.executable, "-c", "import dpjax; print(dpjax.__file__)"],
                              cwd=trees[side], capture_output=True, text=True).stdout.strip()
    if not imported.startswith(str(trees[side])):
      raise RuntimeError(f"{side}: this interpreter imports dpjax from {imported!r}")
    core = None if args.cores is None else args.cores[i % len(args.cores)]
    runs[side] = run_chain(trees[side], scratch / f"workdir_{side}", args.config,
                           settings + (new_only if side == "new" else []), core)
    if args.sequential:
      runs[side].wait()
  status = {side: run.wait() for side, run in runs.items()}
  results = {"commits": commits, "config": args.config, "settings": settings,
             "new_only_settings": new_only, "modes": list(MODES),
             "compare_steps": args.compare_steps, "wall_s": round(time.time() - start),
             "exit_status": status, "comparisons": {}}
  if any(status.values()):
    logs = {side: (scratch / f"workdir_{side}.log").read_text()[-2000:] for side in status}
    results.update(verdict="failed", logs=logs)
    return results
  renamed = dict(pair.split("=", 1) for pair in args.rename_new)
  for name, read in readers(args.compare_steps, renamed).items():
    old, new = (_read(read, scratch / f"workdir_{side}") for side in ("old", "new"))
    results["comparisons"][name] = compare(old, new)
  losses = next(iter(results["comparisons"].values()))
  if losses["compared"] < args.compare_steps:  # a loss per step, or the steps were not compared
    losses["verdict"] = f"only {losses['compared']} steps logged"
  same = all(c["verdict"] == "identical" for c in results["comparisons"].values())
  results["verdict"] = "identical" if same else "different"
  return results


def render(results: dict, command: str) -> str:
  commits = results["commits"]
  lines = [f"# Behaviour check: {commits['old'][:10]} against {commits['new'][:10]}", "",
           f"Command: `{command}`. Each commit ran `run.py {' / '.join(results['modes'])} "
           f"--config {results['config']}` (`make demo`'s chain) with "
           f"`{' '.join(results['settings'])}`, in a worktree of its own; "
           f"{results['wall_s']} s wall for the pair.", "",
           f"Verdict: **{results['verdict']}**.", "", "| compared | values | verdict |",
           "|---|---|---|"]
  if results.get("new_only_settings"):
    lines[2] += (f" The new commit also ran with `{' '.join(results['new_only_settings'])}` "
                 "(settings it added, held at the old behaviour).")
  for name, c in results["comparisons"].items():
    added = f" (the new adds {', '.join(c['added_by_new'])})" if c.get("added_by_new") else ""
    lines.append(f"| {name} | {c['compared']} | {c['verdict']}{added} |")
  for name, c in results["comparisons"].items():
    if "first_difference" in c:
      lines += ["", f"First difference in {name}: `{json.dumps(c['first_difference'])[:400]}`"]
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--old", default="c98f25e", help="the commit before (default: c98f25e)")
  parser.add_argument("--new", default="HEAD", help="the commit after (default: HEAD)")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for both chains, e.g. train.num_steps=100")
  parser.add_argument("--set-new", action="append", default=[], metavar="KEY=VALUE",
                      help="an override for the new commit only: a setting it added, held at "
                           "the old behaviour (e.g. index.merge_spans=False)")
  parser.add_argument("--rename-new", action="append", default=[], metavar="OLD=NEW",
                      help="a compared file the new commit writes under another name (e.g. "
                           "open_eval_Flat.json=open_eval_Flat_unmerged.json)")
  parser.add_argument("--config", default="experiments/demo.py",
                      help="the config both chains run (default: the demo's)")
  parser.add_argument("--compare-steps", type=int, default=100,
                      help="the training steps whose losses are compared (default 100)")
  parser.add_argument("--cores", type=int, nargs="+", default=[0, 1],
                      help="the cores the chains are pinned to (one each; default 0 1)")
  parser.add_argument("--sequential", action="store_true", help="one chain after the other")
  parser.add_argument("--keep", action="store_true", help="keep the worktrees and workdirs")
  parser.add_argument("--note", action="append", default=[])
  parser.add_argument("--out", default="results/behaviour_check.json")
  args = parser.parse_args(argv)
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="behaviour_check_"))
  try:
    results = check(args, scratch)
  finally:
    if not args.keep:
      for tree in scratch.glob("tree_*"):
        git("worktree", "remove", "--force", str(tree))
      subprocess.run(["rm", "-rf", str(scratch)], check=False)
    else:
      print(f"kept: {scratch}")
  results["notes"] = args.note
  results["command"] = command_line(SCRIPT, sys.argv[1:] if argv is None else argv)
  results["date"] = time.strftime("%Y-%m-%d", time.gmtime())
  save_results(args.out, results, render, SCRIPT, argv)
  print(f"behaviour check: {results['verdict']}")
  return 0 if results["verdict"] == "identical" else 1


if __name__ == "__main__":
  sys.exit(main())
