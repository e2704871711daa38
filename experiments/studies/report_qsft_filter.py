"""results/qsft.md and results/filter.md (+ filter.png) from a workdir's QSFT and filter results.

  python experiments/studies/report_qsft_filter.py --workdir workdirs/squad-cpu-unified

Reads `<workdir>/qsft_results_*.json` (`run.py qsft`, e.g. `bash
experiments/studies/squad_qsft.sh`) and `<workdir>/filter_results.json` (`run.py filter`); writes
whichever of the two reports it has data for, with the JSON beside each Markdown file.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

QSFT_COMMANDS = ("bash experiments/studies/squad_qsft.sh {w}   # = run.py qsft --config "
                 "experiments/squad.py:cpu --workdir {w} --set qsft.index=Flat; then "
                 "qsft.index=IVFauto_SQ4 without and with qsft.quantized=True")
FILTER_COMMAND = "python run.py filter --config experiments/squad.py:cpu --workdir {w}"


def _with_notes(lines: list[str], results: dict) -> str:
  from experiments.report import with_notes
  return with_notes(lines, results.get("notes", []))


def qsft_report(results: dict, command: str) -> str:
  runs = results["runs"]
  first = runs[0]
  lines = ["# Query-side fine-tuning (SQuAD-open small)", "",
           f"Commands: `{results['qsft_command']}`; this report: `{command}`.", "",
           f"Model: `{results['workdir']}` (step {results.get('model_step', '?')}); its phrase "
           f"encoder and index are frozen. {first['train_questions']:,} training questions "
           f"(random sample of SQuAD train), dev EM@1 on {first['dev_questions']:,} random dev "
           f"questions over the full index (all {results.get('index_tokens', 0):,} token vectors "
           "of "
           "the 20,958 passages), measured before QSFT and after each epoch; top-k "
           f"{results['top_k']} candidates per question, {results['level']}-level positives.", "",
           "| index | candidates | EM@1 before | EM@1 per epoch | best EM@1 | change | "
           "EM@10 before -> best epoch | questions with a positive (epoch 1) | "
           "train loss per epoch |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in runs:
    epochs = r["epochs"]
    trained = [e for e in epochs if e["train_loss"] is not None]
    best = max(epochs, key=lambda e: e["em@1"]) if epochs else None
    best_em = max([r["before"]["em@1"]] + [e["em@1"] for e in epochs])
    lines.append(
        f"| {r['index']} | "
        f"{'quantizer reconstruction (QAT)' if r['quantized'] else 'stored (exact)'} "
        f"| {r['before']['em@1']:.2f} | {' -> '.join(format(e['em@1'], '.2f') for e in epochs)} | "
        f"{best_em:.2f} | {best_em - r['before']['em@1']:+.2f} | "
        f"{r['before']['em@10']:.2f} -> {best['em@10'] if best else float('nan'):.2f} | "
        f"{epochs[0]['questions_with_positive'] if epochs else 0:,} of {r['train_questions']:,} | "
        f"{', '.join(format(e['train_loss'], '.3f') for e in trained)}"
        " |")
  return _with_notes(lines, results)


def filter_report(results: dict, command: str) -> str:
  r = results["filter"]
  history = r["history"]
  lines = ["# Token filter trained on its own (SQuAD-open small)", "",
           f"Command: `{results['filter_command']}`; this report: `{command}`.", "",
           f"Filter head (384 x 2) trained on the frozen phrase vectors of {r['train_windows']:,} "
           f"training windows, AUC-PR on {r['dev_windows']:,} dev windows (keep score = max of the "
           "start and end logits, positives = gold answer starts/ends among context tokens).", "",
           "| epoch | train loss | dev AUC-PR |", "|---|---|---|"]
  for h in history:
    loss = (f"{h['train_loss']:.4f}" if "train_loss" in h
            else "- (the model's head before this training)")
    lines.append(f"| {h['epoch']} | {loss} | {h['dev_auc_pr']:.4f} |")
  rate = r.get("positive_rate", {}).get("dev")
  if rate is not None:
    lines += ["", f"A random scorer's AUC-PR is the positive rate: {rate:.4f} on these dev tokens."]
  lines += ["", f"Size / accuracy sweep over the full dump ({r['sweep_questions']:,} random dev "
            "questions, exact search over the kept tokens; a phrase starts and ends only at kept "
            "tokens):", "", "| threshold | tokens kept | kept | EM@1 | EM@10 |",
            "|---|---|---|---|---|"]
  for s in r["sweep"]:
    threshold = "none" if s["threshold"] is None else f"{s['threshold']:.3f}"
    lines.append(f"| {threshold} | {s['tokens']:,} | {100 * s['kept_fraction']:.1f}% | "
                 f"{s['em@1']:.2f} | {s['em@10']:.2f} |")
  c = r["chosen"]
  lines += ["", f"Chosen (fewest tokens within {r['max_em_drop']} EM@1 of the unfiltered index): "
            f"threshold {c['threshold']}, {100 * c['kept_fraction']:.1f}% of the tokens, EM@1 "
            f"{c['em@1']:.2f}. ![sweep](filter.png)"]
  return _with_notes(lines, results)


def filter_figure(results: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sweep = sorted(results["filter"]["sweep"], key=lambda s: s["tokens"])
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for key, marker in (("em@1", "o"), ("em@10", "s")):
    ax.plot([s["tokens"] for s in sweep], [s[key] for s in sweep], marker=marker,
            label=key.upper())
  ax.set_xscale("log")
  ax.set_xlabel("index size (tokens kept by the filter)")
  ax.set_ylabel("dev accuracy (%)")
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out-dir", default="results")
  parser.add_argument("--note", action="append", default=[],
                      help="a line added under the tables (what the figures mean, caveats)")
  parser.add_argument("--filter-note", action="append", default=[])
  args = parser.parse_args(argv)
  from dpjax.config import qsft_config
  from experiments.report import elide_notes, save_results
  from dpjax.data.squad import load_json
  argv = elide_notes(sys.argv[1:] if argv is None else argv, ("--note", "--filter-note"))
  workdir = pathlib.Path(args.workdir)
  out_dir = pathlib.Path(args.out_dir)
  wrote = 0
  order = {"Flat": 0, "IVFauto_SQ4": 1}
  runs = sorted((load_json(p) for p in workdir.glob("qsft_results_*.json")),
                key=lambda r: (order.get(r["index"], 2), r["index"], r["quantized"]))
  dump_manifest = workdir / "dump" / "manifest.json"
  tokens = load_json(dump_manifest)["num_tokens"] if dump_manifest.is_file() else 0
  if runs:
    step = load_json(workdir / "results.json").get("step") if (
        workdir / "results.json").is_file() else None
    save_results(out_dir / "qsft.json",
                 {"workdir": str(workdir), "model_step": step, "index_tokens": tokens,
                  # (results of runs before they recorded top_k used the default)
                  "top_k": runs[0].get("top_k", qsft_config().top_k), "level": runs[0]["level"],
                  "qsft_command": QSFT_COMMANDS.format(w=workdir), "runs": runs,
                  "notes": args.note}, qsft_report, "experiments/studies/report_qsft_filter.py",
                 argv)
    wrote += 1
  if (workdir / "filter_results.json").is_file():
    results = {"workdir": str(workdir),
               "filter": load_json(workdir / "filter_results.json"),
               "filter_command": FILTER_COMMAND.format(w=workdir), "notes": args.filter_note}
    out = save_results(out_dir / "filter.json", results, filter_report,
                       "experiments/studies/report_qsft_filter.py", argv)
    filter_figure(results, out.with_suffix(".png"))
    wrote += 1
  if not wrote:
    print(f"{workdir}: no qsft_results_*.json or filter_results.json", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
