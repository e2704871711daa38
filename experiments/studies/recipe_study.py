"""The recipe study of issue 21: runs of one factor each against the baseline, paired tests.

Each run is a workdir trained by `run.py train` (or `run.py teacher`: its `teacher/` folder)
with the final dev RC evaluation (`results.json`, `rc_predictions.json`: every dev question).
For each run: RC EM/F1, the paired difference in EM against the baseline on the same questions
with McNemar's exact test (the questions only one of the two gets right), the training wall time
(from metrics.jsonl), and, where given, H32 / full-corpus EM@1. Writes results/recipe.json
(keys `cpu_baseline`, `cpu_best`, `teacher`, `runs`) and results/recipe.md.

  python experiments/studies/recipe_study.py --config experiments/squad.py:cpu \\
      --run "baseline=workdirs/recipe/base::python run.py train --config ..." \\
      --run "lr 2e-4=workdirs/recipe/lr2e-4::python run.py train ... --set ...=2e-4" \\
      --teacher "teacher=workdirs/recipe/teacher/teacher::python run.py teacher ..." \\
      --best "lr 2e-4" --out results/recipe.json

A run is `name=workdir[:h32_em1[:full_em1]]::command` (the first is the baseline; `-` for a
figure not measured, e.g. `base=workdirs/recipe/base:-:24.0::...`). With
`--validation V.json` (experiments/studies/validation_experiment.py's output, e.g. from
experiments/studies/recipe_gpu.sh), a run's H32 / full EM@1 not given in its spec are taken from
the model whose workdir has the same last folder name (runs made elsewhere and copied here match).
Each run's per-question EM hits are kept in the JSON: with `--previous results/recipe.json`, a
run whose workdir is gone (a wiped machine) is taken from that report, and paired with the others
where its hits were recorded (reports before they were have no p-value for it).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.report import (elide_notes, mcnemar_p, p_text, save_results,  # noqa: E402
                                with_notes)


def two_proportion_p(em_a: float, em_b: float, n: int) -> float:
  """Two-sided p of a pooled two-proportion z-test of two EM percentages over n questions each:
  the unpaired test, for a pair whose per-question hits were not both kept (weaker than
  McNemar's on the same questions)."""
  a, b = em_a / 100, em_b / 100
  pooled = (a + b) / 2
  spread = math.sqrt(2 * pooled * (1 - pooled) / n) if 0 < pooled < 1 else 0.0
  if spread == 0:
    return 1.0 if a == b else 0.0
  return math.erfc(abs(a - b) / spread / math.sqrt(2))


def parse_run(spec: str) -> dict:
  head, _, command = spec.partition("::")
  name, _, rest = head.partition("=")
  parts = rest.split(":")
  number = lambda i: float(parts[i]) if len(parts) > i and parts[i] not in ("", "-") else None
  return {"name": name, "workdir": parts[0], "h32_em1": number(1), "full_em1": number(2),
          "command": command.strip()}


def read_run(run: dict, questions, gold) -> dict:
  """The run's RC scores, per-question EM hits and training time."""
  from dpjax import metrics
  workdir = pathlib.Path(run["workdir"])
  results = json.loads((workdir / "results.json").read_text())
  predictions = json.loads((workdir / "rc_predictions.json").read_text())
  hits = "".join(str(int(metrics.max_over_gold(metrics.exact_match, predictions.get(q.id, ""),
                                               gold[q.id]) > 0)) for q in questions)
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if r.get("split") == "train"]
  # Training time (no evaluation, no checkpoint saving): each logged interval's steps x batch /
  # its examples per second.
  batch = run.get("batch_size")
  seconds, last = 0.0, 0
  for r in train:
    seconds += (r["step"] - last) * (batch or 0) / r["examples_per_sec"]
    last = r["step"]
  return {**run, "rc_em": results["rc_exact_match"], "rc_f1": results["rc_f1"],
          "step": results["step"], "questions": results["count"], "hits": hits,
          "train_seconds": seconds or None}


def validation_em1(paths: list[str]) -> dict[str, tuple[float, float]]:
  """(H32 EM@1, full EM@1) by the last folder name of each model's workdir."""
  found = {}
  for path in paths:
    for model in json.loads(pathlib.Path(path).read_text())["models"].values():
      subcorpora = model["subcorpora"]
      found[pathlib.PurePath(model["workdir"]).name] = (
          subcorpora.get("H32", {}).get("em@1"), subcorpora.get("full", {}).get("em@1"))
  return found


def compare(runs: list[dict]) -> None:
  """Each run against the first: McNemar's exact test where both runs' per-question hits are
  known; else the paired test an earlier report recorded; else (a baseline of a report that kept
  no hits, its workdir gone) the unpaired two-proportion test, marked `test: unpaired`."""
  base = runs[0]
  for run in runs:
    run["delta_em"] = run["rc_em"] - base["rc_em"]
    if run.get("hits") and base.get("hits"):
      a_only, b_only, p = mcnemar_p(run["hits"], base["hits"])
      run.update(only_this=a_only, only_baseline=b_only, p_value=p, test="mcnemar")
    elif run.get("p_value") is not None and run is not base:  # an earlier report's paired test
      run.setdefault("test", "mcnemar")
    else:
      for key in ("only_this", "only_baseline", "p_value"):
        run.setdefault(key, None)
      if run is not base and run.get("questions") == base.get("questions"):
        run.update(p_value=two_proportion_p(run["rc_em"], base["rc_em"], run["questions"]),
                   test="unpaired")


def previous_runs(path: str | None) -> dict[str, dict]:
  """A previous report's runs by name (for runs whose workdir is gone)."""
  if not path:
    return {}
  return {r["name"]: r for r in json.loads(pathlib.Path(path).read_text())["runs"]}


def summary(run: dict | None) -> dict | None:
  if run is None:
    return None
  return {k: run.get(k) for k in ("name", "rc_em", "rc_f1", "h32_em1", "full_em1", "delta_em",
                                  "p_value", "test", "command")}


def render(r: dict, command: str) -> str:
  fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)
  rows = [f"| {x['name']} | {fmt(x['rc_em'])} | {fmt(x['rc_f1'])} | "
          f"{fmt(x['delta_em'], '{:+.2f}')} | {fmt(x['only_this'], '{}')} / "
          f"{fmt(x['only_baseline'], '{}')} | "
          f"{p_text(x['p_value'])}{' (unpaired)' if x.get('test') == 'unpaired' else ''} | "
          f"{fmt(x['h32_em1'])} | {fmt(x['full_em1'])} | "
          f"{fmt(x['train_seconds'] and x['train_seconds'] / 60, '{:.0f}')} | `{x['command']}` |"
          for x in r["runs"]]
  lines = ["# Recipe study (issue 21)", "",
           f"All {r['runs'][0]['questions']} SQuAD v1.1 dev questions, RC EM/F1 of the final "
           f"model; paired against `{r['runs'][0]['name']}` (McNemar's exact test on the questions "
           "only one of the two answers exactly; `(unpaired)`: a two-proportion z-test, where the "
           "baseline's per-question answers were not kept).", "",
           "| run | RC EM | RC F1 | EM vs baseline | right only here / only baseline | p "
           "| H32 EM@1 | full EM@1 | train min | command |", "|---" * 10 + "|",
           *rows, "",
           f"Best CPU recipe: {r['cpu_best']['name'] if r['cpu_best'] else '-'}; teacher: "
           f"{r['teacher']['name'] if r['teacher'] else 'not run'}.", "", "Report command:", "",
           "```bash", command, "```"]
  return with_notes(lines, r.get("notes", []))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--run", action="append", required=True,
                      help="name=workdir[:h32_em1[:full_em1]]::command (first: the baseline)")
  parser.add_argument("--teacher", help="name=workdir/teacher::command")
  parser.add_argument("--best", help="the name of the best CPU recipe's run")
  parser.add_argument("--validation", action="append", default=[],
                      help="validation_experiment.py JSON: H32 / full EM@1 by workdir name")
  parser.add_argument("--previous", help="an earlier recipe.json: runs whose workdir is gone")
  parser.add_argument("--out", default="results/recipe.json")
  parser.add_argument("--note", action="append", default=[])
  args = parser.parse_args(argv)

  from dpjax.config import load_config
  from dpjax.data import Tokenizer, data_files, load_rc_split
  config = load_config(args.config, args.set)
  first = pathlib.Path(parse_run(args.run[0])["workdir"])
  dev = load_rc_split(data_files(config.data, first)["dev"],
                      Tokenizer.from_pretrained(config.model.tokenizer), config.data)
  gold = {q.id: q.answers for q in dev.questions}
  specs = [{**parse_run(s), "batch_size": config.train.batch_size}
           for s in args.run + ([args.teacher] if args.teacher else [])]
  measured = validation_em1(args.validation)
  for spec in specs:
    h32, full = measured.get(pathlib.PurePath(spec["workdir"]).name, (None, None))
    spec["h32_em1"] = h32 if spec["h32_em1"] is None else spec["h32_em1"]
    spec["full_em1"] = full if spec["full_em1"] is None else spec["full_em1"]
  previous = previous_runs(args.previous)
  runs = [read_run(s, dev.questions, gold)
          if (pathlib.Path(s["workdir"]) / "results.json").is_file() or s["name"] not in previous
          else {**previous[s["name"]], "command": s["command"],
                **{k: s[k] for k in ("h32_em1", "full_em1") if s[k] is not None}}
          for s in specs]
  compare(runs)
  by_name = {r["name"]: r for r in runs}
  results = {"cpu_baseline": summary(runs[0]), "cpu_best": summary(by_name.get(args.best)),
             "teacher": summary(runs[-1]) if args.teacher else None,
             "runs": runs,
             "notes": args.note}
  save_results(args.out, results, render, "experiments/studies/recipe_study.py",
               elide_notes(sys.argv[1:] if argv is None else argv))
  return results


if __name__ == "__main__":
  main()
