"""The demo's figures, and which search is its best: dense phrase search against hybrid search on
the synthetic data set of `experiments/demo.py` (what `make demo` trains).

  python experiments/studies/demo_search.py --workdir workdirs/demo --out results/demo.json

Needs a workdir `make demo` made (trained, dumped, Flat index, `run.py eval`). Runs, where their
files are missing, `run.py eval --set index.sparse=False` (dense), then `run.py index --set
index.sparse=True` (the BM25 index, its weights chosen on the demo's training questions) and
`run.py eval --set index.sparse=True`; reports the RC figures of the training run, both searches'
EM@1 / EM@10 / passage Top-1 / Top-20 on the dev questions, McNemar's test of EM@1 and Top-1 and
the weights hybrid search chose. The config's default search should be the better one
(docs/configs.md names it).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments.report import git_commit, mcnemar_p, p_text, save_results  # noqa: E402

CONFIG = "experiments/demo.py"
SEARCHES = {"dense": ("open_eval_Flat.json", ["index.sparse=False"]),
            "hybrid": ("open_eval_Flat_hybrid.json", ["index.sparse=True"])}
SHOWN = ("em@1", "em@10", "top1", "top20")


def run_py(mode: str, workdir: str, overrides: list[str]) -> str:
  """Runs `python run.py MODE` of the demo config (an error stops the study); returns it."""
  args = [sys.executable, "run.py", mode, "--config", CONFIG, "--workdir", workdir]
  for value in overrides:
    args += ["--set", value]
  subprocess.run(args, cwd=ROOT, check=True)
  return shlex.join(["python"] + args[1:])


def search_rows(workdir: pathlib.Path) -> tuple[dict, list[str]]:
  """{search: its eval report}, and the commands run to make the missing ones."""
  commands = []
  if not (workdir / SEARCHES["hybrid"][0]).is_file():
    commands.append(run_py("index", str(workdir), ["index.sparse=True", "index.specs=[]"]))
  rows = {}
  for name, (file, overrides) in SEARCHES.items():
    if not (workdir / file).is_file():
      commands.append(run_py("eval", str(workdir), overrides))
    rows[name] = json.loads((workdir / file).read_text())
  return rows, commands


def paired(a: dict, b: dict, metric: str) -> dict:
  """McNemar's exact test of one search's per-question hits of `metric` against another's."""
  only_a, only_b, p = mcnemar_p(a["hits"][metric], b["hits"][metric])
  return {"only_first": only_a, "only_second": only_b, "p": p}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="workdirs/demo")
  parser.add_argument("--out", default="results/demo.json")
  args = parser.parse_args(argv)
  workdir = pathlib.Path(args.workdir)
  rc = json.loads((workdir / "results.json").read_text())
  rows, commands = search_rows(workdir)
  for name, row in rows.items():
    if row.get("model_step") != rc.get("step"):
      raise SystemExit(f"{name}: eval of model step {row.get('model_step')}, the training "
                       f"ended at {rc.get('step')}: evaluate the workdir again")
  results = {
      "commit": git_commit(), "workdir": str(workdir), "config": CONFIG, "runs": commands,
      "rc": {k: rc[k] for k in ("rc_exact_match", "rc_f1", "count", "step")},
      "searches": {name: {**{k: row[k] for k in SHOWN}, "questions": row["questions"],
                          "hybrid": row.get("hybrid") and {
                              k: row["hybrid"][k] for k in ("weight", "sentence_weight")}}
                   for name, row in rows.items()},
      "paired": {m: paired(rows["hybrid"], rows["dense"], m) for m in ("em@1", "top1")
                 if "hits" in rows["hybrid"] and m in rows["hybrid"]["hits"]},
  }
  save_results(args.out, results, render, "experiments/studies/demo_search.py", argv)
  return 0


def render(results: dict, command: str) -> str:
  rc, searches = results["rc"], results["searches"]
  lines = ["# The demo: dense against hybrid search", "",
           f"Command: `{command}` at commit {results['commit']}, over `{results['workdir']}` "
           f"(`make demo`: `{results['config']}`, model step {rc['step']}).", "",
           f"Reading comprehension on the {rc['count']} dev questions: EM "
           f"{rc['rc_exact_match']:.2f}, F1 {rc['rc_f1']:.2f}.", "",
           "| search | EM@1 | EM@10 | passage Top-1 | Top-20 | weights (passage, sentence) |",
           "|---|---|---|---|---|---|"]
  for name, row in searches.items():
    weights = row["hybrid"] and f"{row['hybrid']['weight']:g}, {row['hybrid']['sentence_weight']:g}"
    lines.append(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in SHOWN)
                 + f" | {weights or '-'} |")
  for metric, test in results["paired"].items():
    lines += ["", f"{metric}, hybrid against dense: right only with hybrid {test['only_first']}, "
                  f"only with dense {test['only_second']}, McNemar p {p_text(test['p'])}."]
  if results["runs"]:
    lines += ["", "Runs made by this command:", ""] + [f"- `{c}`" for c in results["runs"]]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
