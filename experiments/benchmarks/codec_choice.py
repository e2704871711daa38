"""The compact index's codec chosen by measurement: dense EM@1 and passage Top-k of the same dev
questions over Flat (every token, and the filter's kept tokens) and over compact indexes of
several codecs at that filter threshold, from `run.py eval` reports.

  python experiments/benchmarks/codec_choice.py --workdir workdirs/squad-cpu \\
      --reports workdirs/squad-cpu/codec_choice/*.json --out results/codec_choice.json

Each report is one `run.py eval --set index.sparse=False --set eval.limit=N --set
index.search_index=<index>` (the commands are given with --command); the table adds each index's
bytes per kept token (the codec's code, from the index manifest) and per corpus token (every part
of the index folder).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.report import elide_notes, save_results, with_notes  # noqa: E402

KEYS = ("em@1", "em@10", "top1", "top5", "top20")


def row(report: dict, dump: pathlib.Path, corpus_tokens: int) -> dict:
  """A report's figures and its index's sizes."""
  folder = dump / "indexes" / report["index"]
  manifest = json.loads((folder / "index_manifest.json").read_text())
  disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
  out = {k: report[k] for k in KEYS}
  out.update(index=report["index"], spec=manifest["resolved_spec"],
             kept_tokens=manifest["num_tokens"], kept=manifest["num_tokens"] / corpus_tokens,
             filter_threshold=manifest.get("filter_threshold"), model_step=report["model_step"],
             fingerprint=report["fingerprint"], questions=report["questions"],
             index_bytes_per_corpus_token=disk / corpus_tokens,
             code_bytes_per_kept_token=(manifest.get("code_size")
                                        or _code_size(folder, manifest)))
  return out


def _code_size(folder: pathlib.Path, manifest: dict) -> float | None:
  """Bytes of one kept token's code (a compact index's codes.npy row; Flat: float32)."""
  if manifest.get("kind") == "compact":
    import numpy as np
    return int(np.load(folder / "codes.npy", mmap_mode="r").shape[1])
  return 4 * manifest.get("dim", 0) or None


def render(results: dict, command: str) -> str:
  lines = ["# Which code a compact index stores (dense search, SQuAD-open small)", "",
           f"Rendered by `{command}` from `run.py eval` reports (their commands below, run at "
           f"{results['measured_at']}); "
           f"{results['questions']:,} dev questions (the first of the file), model step "
           f"{results['model_step']}.", "",
           "| index | tokens kept | code bytes per kept token | index bytes per corpus token | "
           + " | ".join(KEYS) + " |", "|---" * (4 + len(KEYS)) + "|"]
  for r in results["rows"]:
    lines.append(f"| {r['index']} | {r['kept_tokens']:,} ({100 * r['kept']:.0f}%) | "
                 f"{r['code_bytes_per_kept_token'] or '-'} | "
                 f"{r['index_bytes_per_corpus_token']:.1f} | "
                 + " | ".join(f"{r[k]:.2f}" for k in KEYS) + " |")
  lines += ["", "Commands:", ""] + [f"- `{c}`" for c in results["commands"]]
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--reports", nargs="+", required=True)
  parser.add_argument("--command", action="append", default=[],
                      help="a command that made the reports (recorded)")
  parser.add_argument("--measured-at", required=True,
                      help="the commit the reports' runs were made at")
  parser.add_argument("--out", required=True)
  parser.add_argument("--note", action="append", default=[])
  args = parser.parse_args(argv)
  from dpjax.index.manifest import read_manifest
  dump = pathlib.Path(args.workdir) / "dump"
  tokens = read_manifest(dump)["num_tokens"]
  reports = [json.loads(pathlib.Path(p).read_text()) for p in args.reports]
  if len({(r["questions"], r["fingerprint"], r["model_step"]) for r in reports}) != 1:
    raise SystemExit("the reports are not of the same questions and model")
  rows = sorted((row(r, dump, tokens) for r in reports),
                key=lambda r: (r["spec"] != "Flat", -r["kept"], r["code_bytes_per_kept_token"]
                               or 0))
  results = {"workdir": args.workdir, "corpus_tokens": tokens, "measured_at": args.measured_at,
             "questions": reports[0]["questions"], "model_step": reports[0]["model_step"],
             "rows": rows, "commands": args.command, "notes": args.note}
  save_results(args.out, results, render, "experiments/benchmarks/codec_choice.py",
               elide_notes(sys.argv[1:] if argv is None else argv, ("--note", "--command")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
