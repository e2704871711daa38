"""The chosen compact index coded at dump time against the same index coded from the float16
dump, on SQuAD-open small: what the dump writes (bytes by part, seconds, peak memory, the codec's
sample), the bytes a search reads, and every dev question searched through both (dense, hybrid,
hybrid re-reading within a margin), with McNemar's exact test per pair.

  python experiments/benchmarks/dump_codes_squad.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu-rd --reference workdirs/squad-cpu \\
      --reference-index compact_qw_pr_OPQ24_PQ24_filter-2.91406 --codec qw+pr:OPQ24,PQ24 \\
      --threshold -2.9140625 --index-set index.sparse_weight=0.5 ... --reread-margin 3:3 \\
      --reread-set index.sparse_weight=1 ... \\
      --dump-log logs/rd_dump.err --out results/dump_codes_squad.json

Through run.py, what is missing (`--workdir` holds the model and filter head, no dump yet):
`dump` with `index.dump_codec=<codec>`, `index.dump_vectors=False` and
`index.dump_filter_threshold=<threshold>` (the threshold the reference index filtered with at
index time), `index` of `compact:<codec>` (assembled from the dump's codes) with the BM25 index,
then `eval` of each row. The reference rows are the reference workdir's eval reports of the same
searches over its index (`--reference-index`), which must exist. `--dump-log` / `--index-log`:
GNU time's `-v` output of those runs, for their peak resident memory (the commands that made
them are recorded beside it, `--note`). The hybrid weights are set, not chosen
(`--index-set index.sparse_weight=...`: those the reference's BM25 index records), so that both
indexes search with the same ones.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments" / "benchmarks"))
from experiments.report import command_line, elide_notes, git_commit  # noqa: E402
from compact_squad import (  # noqa: E402
    _complete, _count_and_margin, eval_file, run_py, served_bytes)

KEYS = ("em@1", "em@10", "top1", "top5", "top20")
PAIRED = ("em@1", "top1", "top20")


def rows_of(args, folder: str) -> dict:
  """{row: eval overrides over index `folder`}: dense, hybrid, and each `--reread-margin`."""
  base = [f"index.search_index={folder}"]
  rows = {"dense": base + ["index.sparse=False"], "hybrid": base + ["index.sparse=True"]}
  for passages, margin in args.reread_margin:
    rows[f"hybrid, reread {passages} within {margin:g}"] = base + [
        "index.sparse=True", f"index.reread={passages}", f"index.reread_margin={margin}",
        *args.reread_set]
  return rows


def build_and_evaluate(args) -> tuple[dict, dict]:
  """(the dump-time index's eval reports by row, the commands run), running what is missing."""
  from dpjax.index.faiss_index import index_folder
  workdir, spec = pathlib.Path(args.workdir), f"compact:{args.codec}"
  dump, commands = workdir / "dump", {}
  if args.rerun or not (dump / "manifest.json").is_file() or not json.loads(
      (dump / "manifest.json").read_text()).get("complete"):
    commands["dump"] = run_py("dump", args, [
        f"index.dump_codec={args.codec}", "index.dump_vectors=False",
        f"index.dump_filter_threshold={args.threshold!r}"])
  folder = index_folder(spec)
  if args.rerun or not (dump / "indexes" / folder / "index_manifest.json").is_file():
    commands["index"] = run_py("index", args, [f"index.specs=['{spec}']", "index.sparse=True",
                                               *args.index_set])
  reports = {}
  for name, overrides in rows_of(args, folder).items():
    path = eval_file(args, overrides)
    if args.rerun or not path.is_file() or not _complete(path, args.questions):
      commands[f"eval {name}"] = run_py("eval", args, overrides)
    reports[name] = json.loads(path.read_text())
  return reports, commands


def reference_reports(args) -> dict:
  """The reference workdir's eval reports of the same rows over `--reference-index`."""
  out = {}
  for name, overrides in rows_of(args, args.reference_index).items():
    path = eval_file(argparse.Namespace(config=args.config, workdir=args.reference,
                                        set=args.set), overrides)
    if not path.is_file():
      raise SystemExit(f"{path}: no reference eval report for the row {name!r}; run it first")
    out[name] = json.loads(path.read_text())
  return out


def peak_memory(log: str | None) -> dict | None:
  """Peak resident GiB and wall seconds of a run from GNU time's `-v` output (None: no log)."""
  if not log:
    return None
  text = pathlib.Path(log).read_text()
  kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
  wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1)
  seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(wall.split(":"))))
  return {"log": log, "peak_gib": kib / 2 ** 20, "wall_seconds": seconds}


def dump_record(dump: pathlib.Path) -> dict:
  """What the dump wrote: its bytes per corpus token by file name (over its shards), seconds
  and the codec's record."""
  manifest = json.loads((dump / "manifest.json").read_text())
  tokens = manifest["context_tokens"]
  parts: dict[str, int] = {}
  for path in dump.glob("*"):
    if path.is_file():
      parts[path.name] = path.stat().st_size
  for path in dump.glob("shard_*/*"):
    parts[path.name] = parts.get(path.name, 0) + path.stat().st_size
  return {"corpus_tokens": tokens, "kept_tokens": manifest["num_tokens"],
          "seconds": manifest["seconds"], "codec": manifest["codec"],
          "per_token": {k: v / tokens for k, v in sorted(parts.items())},
          "total_per_token": sum(parts.values()) / tokens}


def summarise(args, reports: dict, reference: dict, commands: dict) -> dict:
  from dpjax import metrics
  from dpjax.index.faiss_index import index_folder
  dump = pathlib.Path(args.workdir) / "dump"
  rows = {name: {"dump time": {k: reports[name][k] for k in KEYS},
                 "index time": {k: reference[name][k] for k in KEYS},
                 "mcnemar": {k: metrics.mcnemar_p(reports[name]["hits"][k],
                                                  reference[name]["hits"][k]) for k in PAIRED}}
          for name in reports}
  index = json.loads((dump / "indexes" / index_folder(f"compact:{args.codec}")
                      / "index_manifest.json").read_text())
  reference_dump = json.loads((pathlib.Path(args.reference) / "dump" / "manifest.json").read_text())
  return {"commit": git_commit(), "config": args.config, "workdir": str(args.workdir),
          "reference": f"{args.reference}, index {args.reference_index}", "codec": args.codec,
          "filter_threshold": args.threshold, "questions": reports["dense"]["questions"],
          "rows": rows, "dump": {**dump_record(dump), "run": peak_memory(args.dump_log)},
          "index": {"build_seconds": index["build_seconds"], "run": peak_memory(args.index_log)},
          "reference_dump": {key: reference_dump[key] for key in ("bytes_per_token", "seconds")},
          "served_bytes": served_bytes(dump, index_folder(f"compact:{args.codec}")),
          "commands": commands, "notes": args.note}


def render(section: dict) -> str:
  """The Markdown of a `summarise` record."""
  dump, served = section["dump"], section["served_bytes"]
  lines = [f"# A compact index coded at dump time (SQuAD-open small)", "",
           f"Written by `{section['command']}` at {section['commit'][:12]}.", "",
           f"`compact:{section['codec']}` coded as the dump is made (filter threshold "
           f"{section['filter_threshold']} at dump time), against the same codec coded at index "
           f"time from the float16 dump ({section['reference']}); all "
           f"{section['questions']:,} dev questions.", "",
           "| search | EM@1 dump / index time | Top-1 | Top-20 | McNemar EM@1 (p) | Top-1 (p) |",
           "|---|---|---|---|---|---|"]
  for name, row in section["rows"].items():
    ours, theirs, test = row["dump time"], row["index time"], row["mcnemar"]
    lines.append(
        f"| {name} | {ours['em@1']:.2f} / {theirs['em@1']:.2f} | {ours['top1']:.2f} / "
        f"{theirs['top1']:.2f} | {ours['top20']:.2f} / {theirs['top20']:.2f} | "
        f"{test['em@1'][0]} / {test['em@1'][1]} ({test['em@1'][2]:.2g}) | "
        f"{test['top1'][0]} / {test['top1'][1]} ({test['top1'][2]:.2g}) |")
  run = dump["run"] or {}
  sample = dump["codec"]["sample"]
  lines += ["", "McNemar: questions only the dump-time index answers / only the index-time one.",
            "", f"The dump: {dump['kept_tokens']:,} of {dump['corpus_tokens']:,} tokens kept, "
            f"{dump['total_per_token']:.2f} bytes per corpus token on disk, "
            f"{dump['seconds']:.0f} s "
            f"(the reference's float16 dump: {section['reference_dump']['bytes_per_token']:.1f} "
            f"bytes, {section['reference_dump']['seconds']:.0f} s)"
            + (f", peak resident memory {run['peak_gib']:.2f} GiB" if run else "") + "; the "
            f"codec sample {sample['passages']:,} passages in {sample['reads']} reads "
            f"({sample['kept_tokens']:,} kept tokens, {dump['codec']['train_tokens']:,} drawn; "
            f"means codec {dump['codec'].get('means_codec')}). The index assembled from it in "
            f"{section['index']['build_seconds']:.1f} s"
            + (f" (its run's peak {section['index']['run']['peak_gib']:.2f} GiB)"
               if section["index"]["run"] else "") + ". Served: "
            f"{served['total_per_token']:.2f} bytes per corpus token (compact index, BM25, "
            f"the dump's manifest).", "", "| dump file | bytes per corpus token |", "|---|---|"]
  lines += [f"| {name} | {value:.3f} |" for name, value in dump["per_token"].items()]
  lines += ["", *[f"- {note}" for note in section["notes"]]]
  return "\n".join(lines) + "\n"


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--reference", required=True, help="the workdir of the index-time index")
  parser.add_argument("--reference-index", required=True, help="its folder under indexes/")
  parser.add_argument("--codec", default="qw+pr:OPQ24,PQ24")
  parser.add_argument("--threshold", type=float, required=True, help="dump-time filter")
  parser.add_argument("--reread-margin", action="append", type=_count_and_margin, default=[])
  parser.add_argument("--reread-set", action="append", default=[])
  parser.add_argument("--set", action="append", default=[], help="for every run.py")
  parser.add_argument("--index-set", action="append", default=[],
                      help="for run.py index only (the hybrid weights: index.sparse_weight=...)")
  parser.add_argument("--questions", type=int, default=10570)
  parser.add_argument("--dump-log")
  parser.add_argument("--index-log")
  parser.add_argument("--rerun", action="store_true")
  parser.add_argument("--out", default="results/dump_codes_squad.json")
  parser.add_argument("--note", action="append", default=[])
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  from dpjax.config import setup_logging
  from dpjax.io import write_json, write_text_atomic
  setup_logging(fmt="%(asctime)s %(name)s: %(message)s")
  reports, commands = build_and_evaluate(args)
  section = summarise(args, reports, reference_reports(args), commands)
  section["command"] = command_line("experiments/benchmarks/dump_codes_squad.py",
                                    elide_notes(sys.argv[1:] if argv is None else argv))
  out = pathlib.Path(args.out)
  write_json(out, section)
  write_text_atomic(out.with_suffix(".md"), render(section))
  print(out.with_suffix(".md").read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
