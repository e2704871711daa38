"""Hybrid search against dense search, BM25 and the retriever-reader peers, on the same questions
(SQuAD-open small: the dev questions over every train + dev paragraph).

  python experiments/benchmarks/hybrid.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --reader-json results/reader_peer.json --out results/hybrid.json

It runs, through run.py, what is missing or has no per-question hits (everything with
--rerun): `eval` (dense), `eval --set index.merge_spans=False` (overlapping spans apart: the
merging's effect on EM@10), `index --set index.sparse=True` (the BM25 index and its weights,
chosen on training questions), `eval --set index.sparse=True` (hybrid) and the hybrid with
passage BM25 alone at its best weight on those training questions (what the sentence term
adds); it scores BM25 alone over the dump's passages itself; the reader rows (the reader alone,
and mixed with its retriever's scores) come from `experiments/benchmarks/reader_peer.py`'s JSON.
McNemar's exact test pairs hybrid with dense and with the passage-only hybrid (EM@1, passage
Top-1, Top-20), with BM25 (Top-1, Top-20) and with each reader row (EM@1) on the same
questions. Writes the JSON and a Markdown table (`--out` with .md) with every command.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shlex
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

ROOT = pathlib.Path(__file__).resolve().parents[2]
from experiments.report import git_commit  # noqa: E402
RUNS = {  # row: (its eval file, the run.py overrides that make it)
    "dense": ("open_eval_Flat.json", ["index.sparse=False"]),
    "dense, spans not merged": ("open_eval_Flat_unmerged.json",
                                ["index.sparse=False", "index.merge_spans=False"]),
    "hybrid": ("open_eval_Flat_hybrid.json", ["index.sparse=True"]),
}
PASSAGE_ONLY = "hybrid, passage BM25 only"  # what the sentence term adds: `passage_only_run`
SHOWN = ("em@1", "em@10", "top1", "top5", "top20", "mrr@20")  # the table's columns


def is_reader(name: str) -> bool:
  """reader_peer.py's reader rows: `NAME+reader` and `NAME+reader (mixed)`."""
  return name.endswith(("+reader", "+reader (mixed)"))


def run_py(mode: str, config: str, workdir: str, overrides: list[str]) -> str:
  """Runs `python run.py MODE` (an error stops the report); returns the command."""
  args = [sys.executable, "run.py", mode, "--config", config, "--workdir", workdir]
  for value in overrides:
    args += ["--set", value]
  logging.info("running %s", shlex.join(args[1:]))
  subprocess.run(args, cwd=ROOT, check=True)
  return shlex.join(["python"] + args[1:])


def reusable(path: pathlib.Path, questions: int, dump: pathlib.Path,
             weights: tuple | None = None) -> bool:
  """Whether an eval report can stand as its row: there, of the dump's model, with per-question
  hits of all the questions (reports written before eval recorded them are run again), and a
  hybrid one with the weights the BM25 index records now (or `weights`, set by hand)."""
  from dpjax.index.manifest import read_manifest
  from dpjax.index.sparse import MANIFEST, sparse_folder
  if not path.is_file():
    return False
  report = json.loads(path.read_text())
  hits = report.get("hits", {})
  if (report.get("fingerprint") != read_manifest(dump)["fingerprint"]
      or not all(len(hits.get(key, "")) == questions for key in ("em@1", "top1", "top20"))):
    return False
  bm25 = sparse_folder(dump) / MANIFEST
  if not report.get("hybrid"):
    return True
  recorded = json.loads(bm25.read_text()) if bm25.is_file() else {}
  if recorded.get("num_sentences") is None or recorded.get("sentence_weight") is None:
    return False  # an index of older code: `run.py index` builds it again
  wanted = weights or (recorded["weight"], recorded["sentence_weight"])
  return (report["hybrid"].get("weight"), report["hybrid"].get("sentence_weight")) == wanted


def passage_only_run(dump: pathlib.Path) -> tuple[str, list[str], tuple]:
  """(eval file, overrides, weights) of the hybrid with passage BM25 alone at its best weight on
  the tuning questions (`fusion.choose_weight`'s record in the BM25 index's manifest)."""
  from dpjax.index.sparse import MANIFEST, sparse_folder
  scores = json.loads((sparse_folder(dump) / MANIFEST).read_text())["weight_tuning"]["scores"]
  weight = float(best_passage_only(scores).split(",")[0])
  return (f"open_eval_Flat_hybrid_w{weight:g}_s0.json",
          ["index.sparse=True", f"index.sparse_weight={weight}",
           "index.sparse_sentence_weight=0.0"], (weight, 0.0))


def evaluated(args, index, questions: int) -> dict:
  """Every eval row: its report (run unless `reusable` and not --rerun) and its command
  (`index`: the config's IndexSettings)."""
  rows, workdir = {}, pathlib.Path(args.workdir)
  dump = workdir / index.dump_name
  for name in [*RUNS, PASSAGE_ONLY]:  # (the passage-only weight: from the hybrid's index)
    file, overrides, weights = (*RUNS[name], None) if name in RUNS else passage_only_run(dump)
    sets = overrides + args.set
    run = args.rerun or not reusable(workdir / file, questions, dump, weights)
    if name == "hybrid" and run:
      run_py("index", args.config, args.workdir, sets + ["index.specs=[]"])
    command = shlex.join(["python", "run.py", "eval", "--config", args.config, "--workdir",
                          args.workdir] + [x for v in sets for x in ("--set", v)])
    if run:
      command = run_py("eval", args.config, args.workdir, sets)
    rows[name] = {"report": json.loads((workdir / file).read_text()), "command": command}
  return rows


def bm25_row(index, workdir: pathlib.Path, answers, texts: list[str], k: int = 20) -> dict:
  """BM25 alone over the dump's passages (the hybrid's BM25 index; `index`: the config's
  IndexSettings): passage Top-k, MRR@20, questions/s, per-question top-1 / top-20 hits."""
  from dpjax import metrics
  from dpjax.index.dump import Dump
  from dpjax.index.hybrid import top_passages
  from dpjax.index.manifest import read_manifest
  from dpjax.index.sparse import SparseIndex
  directory = workdir / index.dump_name
  manifest, passages = read_manifest(directory), Dump.read_passages(directory)
  sparse = SparseIndex(directory, manifest)
  start, ranked = time.perf_counter(), []
  for lo in range(0, len(texts), 256):
    ranked += top_passages(sparse.scores(texts[lo:lo + 256]), k)
  seconds = time.perf_counter() - start
  docs = [[passages[row].text for row in rows] for rows in ranked]
  scores = metrics.passage_scores(docs, answers, ks=(1, 5, 20), mrr_k=20, precision_k=20)
  hits = {f"top{n}": "".join(str(int(any(metrics.has_answer(d, g) for d in ds[:n])))
                             for ds, g in zip(docs, answers)) for n in (1, 20)}
  return {**scores, "hits": hits, "questions_per_sec": len(texts) / seconds,
          "index_bytes_per_token": sparse.manifest["index_bytes"] / manifest["num_tokens"],
          "settings": sparse.manifest["settings"]}


def merging_effect(workdir: pathlib.Path) -> dict | None:
  """EM@10 question by question with overlapping spans merged and not (the dense eval's two
  predictions files): right only unmerged (and of those, how many by a span overlapping one of
  the merged list's, a boundary variant of an answer listed), right only merged."""
  from dpjax import metrics
  files = [workdir / f"open_predictions_Flat{suffix}.jsonl" for suffix in ("", "_unmerged")]
  if not all(f.is_file() for f in files):
    return None
  merged, unmerged = ([json.loads(line) for line in f.open()] for f in files)
  right = lambda p, gold: metrics.max_over_gold(metrics.exact_match, p, gold) > 0
  effect = {"only_unmerged": 0, "only_unmerged_by_an_overlapping_span": 0, "only_merged": 0}
  for m, u in zip(merged, unmerged):
    hit_m = any(right(p, m["answers"]) for p in m["predictions"][:10])
    hit_u = [s for p, s in zip(u["predictions"][:10], u["spans"][:10]) if right(p, u["answers"])]
    effect["only_merged"] += hit_m and not hit_u
    if hit_u and not hit_m:
      effect["only_unmerged"] += 1
      effect["only_unmerged_by_an_overlapping_span"] += any(
          s[0] == t[0] and s[1] < t[2] and t[1] < s[2] for s in hit_u for t in m["spans"][:10])
  return effect


def check_reader_questions(path, readers: dict, questions, sample) -> None:
  """Refuses reader rows of other questions: their digest (reader_peer.py records one) must be
  that of these questions, or of the sample's rows of them."""
  from experiments.benchmarks.reader_peer import questions_digest
  if sample and max(sample) >= len(questions):
    raise SystemExit(f"{path}: its sample reaches question {max(sample)}, past these "
                     f"{len(questions)}")
  read = [questions[i] for i in sample] if sample else questions
  recorded = readers.get("questions_sha256")
  if recorded is None:
    logging.warning("%s records no digest of its questions: matched by count only", path)
  elif recorded != questions_digest(read):
    raise SystemExit(f"{path}: its reader rows read other questions than these")


def best_passage_only(scores: dict) -> str:
  """The `fusion.pair_key` of the best pair with sentence weight 0 in a tuning record's scores,
  by `fusion.choose_weight`'s criterion and tie-break (the smaller weight)."""
  return max((key for key in scores if key.endswith(",0")),
             key=lambda key: (round(scores[key]["em@1"] + scores[key]["top1"], 6),
                              -float(key.split(",")[0])))


def check_hybrid_weight(path, readers: dict, hybrid: dict) -> None:
  """Refuses hybrid reader rows searched with other weights than the hybrid eval's, or whose
  weights are not recorded (rows made before they were)."""
  weights = _weights(hybrid.get("hybrid") or {})
  for name, row in readers["systems"].items():
    if name.startswith("hybrid") and _weights(row.get("hybrid") or {}) != weights:
      raise SystemExit(f"{path}: {name} searched with hybrid weights "
                       f"{_weights(row.get('hybrid') or {})}, the hybrid eval with {weights}: "
                       "run one of them again")


def _weights(record: dict) -> tuple:
  """(passage, sentence) weights of a hybrid record (None: not recorded)."""
  return record.get("weight"), record.get("sentence_weight")


def on_rows(row: dict, rows: list[int]) -> dict:
  """A row's per-question hits, and the shares (x100) they give, on the questions at `rows`."""
  hits = {key: "".join(value[i] for i in rows) for key, value in row["hits"].items()}
  return {**{key: 100.0 * value.count("1") / len(rows) for key, value in hits.items()},
          "hits": hits}


def paired(a: dict, b: dict, keys) -> dict:
  """McNemar's exact test of two rows' per-question hits: {key: (a only, b only, p)}."""
  from dpjax import metrics
  return {key: metrics.mcnemar_p(a["hits"][key], b["hits"][key]) for key in keys
          if key in a.get("hits", {}) and key in b.get("hits", {})}


def table(result: dict, command: str) -> str:
  from experiments.report import p_text
  lines = [f"# Hybrid search ({result['questions']} questions)", "", f"Command: `{command}`",
           f"(commit {result['commit']})", "",
           "| system | " + " | ".join(SHOWN) + " | questions/s | index bytes/token |",
           "|---" * (len(SHOWN) + 3) + "|"]
  number = lambda v, digits=2: "-" if v is None else f"{v:.{digits}f}"
  sample = result.get("reader_sample")
  for name, row in result["rows"].items():
    if sample and is_reader(name):  # (on their sample only: the table below)
      continue
    lines.append(f"| {name} | " + " | ".join(number(row.get(k)) for k in SHOWN)
                 + f" | {number(row.get('questions_per_sec'), 1)}"
                 + f" | {number(row.get('index_bytes_per_token'), 1)} |")
  if sample:
    lines += ["", f"The reader rows read {sample['questions']} random questions of these (seed "
              f"{sample['seed']}); all rows on those questions (questions/s: the reader "
              "rows', retrieval and reading in sequence):", "",
              "| system | em@1 | top1 | top20 | questions/s |", "|---|---|---|---|---|"]
    lines += [f"| {name} | " + " | ".join(number(row.get(k)) for k in ("em@1", "top1", "top20"))
              + " | |" for name, row in sample["rows"].items()]
    lines += [f"| {name} | {number(row['em@1'])} | - | - | "
              f"{number(row['questions_per_sec'], 1)} |"
              for name, row in result["rows"].items() if is_reader(name)]
  lines += tuning_lines(result["rows"].get("hybrid", {}).get("hybrid") or {})
  effect = result.get("merging_em@10")
  if effect:
    lines += ["", f"EM@10, spans merged against not merged (dense): right only not merged "
              f"{effect['only_unmerged']} (of them {effect['only_unmerged_by_an_overlapping_span']}"
              " by a span overlapping an answer of the merged list), right only merged "
              f"{effect['only_merged']}."]
  lines += ["", "McNemar's exact test: questions right only in the first system / only in the "
            "second, two-sided p" + (" (reader rows: on their sample)" if sample else "") + ".",
            ""]
  for pair, tests in result["paired"].items():
    lines.append(f"- {pair}: " + "; ".join(f"{k} {a} / {b}, p = {p_text(p)}"
                                           for k, (a, b, p) in tests.items()))
  lines += ["", "Each row's command:", ""] + [f"- {name}: `{c}`"
                                              for name, c in result["commands"].items()]
  from experiments.report import with_notes
  return with_notes(lines, result.get("notes", []))


def tuning_lines(hybrid: dict) -> list[str]:
  """How the hybrid weights were chosen: the chosen pair's scores on the tuning questions, and
  the best pair without the sentence term's (`hybrid_weights.choose_weight`'s record)."""
  tuning = hybrid.get("weight_tuning") or {}
  scores = tuning.get("scores")
  if not scores:
    return []
  from dpjax.index.hybrid_weights import pair_key
  chosen, alone = pair_key(hybrid["weight"], hybrid["sentence_weight"]), best_passage_only(scores)
  said = lambda key: (f"passage {key.split(',')[0]}, sentence {key.split(',')[1]}: EM@1 "
                      f"{scores[key]['em@1']:.2f}, Top-1 {scores[key]['top1']:.2f}")
  return ["", f"Hybrid weights chosen by `run.py index` on {tuning['questions']} training "
              f"questions of {tuning['file']} (seed {tuning['seed']}; never these): "
              f"{said(chosen)}" + (f"; the best without the sentence term, {said(alone)}"
                                   if alone != chosen else "")
          + f". Every pair's scores are in the JSON (rows.hybrid.hybrid.weight_tuning)."]


def eval_row(report: dict) -> dict:
  row = {k: report[k] for k in SHOWN if k in report}
  row["hits"] = report.get("hits", {})
  row["questions_per_sec"] = report["questions"] / report["search_seconds"]
  row["questions_per_sec_batch64"] = report["questions_per_sec_batch64"]
  row["index_bytes_per_token"] = report["index_bytes_per_token"] + (
      (report.get("hybrid") or {}).get("bm25_bytes_per_token", 0.0))
  if report.get("hybrid"):
    row["hybrid"] = {k: v for k, v in report["hybrid"].items()}
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--set", action="append", default=[], help="overrides for every run")
  parser.add_argument("--reader-json", help="reader_peer.py's JSON (its reader rows)")
  parser.add_argument("--rerun", action="store_true", help="rerun the evals that exist")
  parser.add_argument("--out", required=True)
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph under the table")
  args = parser.parse_args(argv)
  hand_set = [v for v in args.set if v.startswith(("index.sparse_weight=",
                                                   "index.sparse_sentence_weight="))]
  if hand_set:  # its rows are the tuned weights' and the passage-only one's
    parser.error(f"--set {hand_set[0]}: the hybrid weights are run.py index's choice here")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
  from dpjax.config import load_config
  from dpjax.data.questions import read_questions
  from dpjax.loading import data_paths
  from dpjax.settings import Settings
  settings = Settings.of(load_config(args.config, args.set))
  workdir = pathlib.Path(args.workdir)
  questions = read_questions(data_paths(settings.data, settings.index, workdir)["questions"])
  if settings.eval.limit:
    questions = questions[:settings.eval.limit]
  evals = evaluated(args, settings.index, len(questions))
  rows = {name: eval_row(e["report"]) for name, e in evals.items()}
  rows["bm25"] = bm25_row(settings.index, workdir, [q.answers for q in questions],
                          [q.question for q in questions])
  commands = {name: e["command"] for name, e in evals.items()}
  commands["bm25"] = "this script (BM25 over the dump's passages, the hybrid's BM25 index)"
  sample = None
  if args.reader_json:  # the reader rows, on the same questions (or a sample of them)
    readers = json.loads(pathlib.Path(args.reader_json).read_text())
    sample = readers.get("question_rows")
    check_reader_questions(args.reader_json, readers, questions, sample)
    for name, row in readers["systems"].items():
      if is_reader(name):
        rows[name] = {"em@1": row["em@1"], "hits": row["hits"],
                      "questions_per_sec": row["questions_per_sec"]["pipeline"]}
    commands["readers"] = f"see {args.reader_json} (commit {readers.get('commit')})"
  for name, row in rows.items():
    count = len(row["hits"].get("em@1") or row["hits"].get("top1", ""))
    expected = len(sample) if sample and is_reader(name) else len(questions)
    if count != expected:
      raise SystemExit(f"{name}: {count} questions, expected {expected}: rerun it (--rerun, "
                       "or reader_peer.py on the same questions)")
  result = {"merging_em@10": merging_effect(workdir),
            "questions": len(questions), "config": args.config, "workdir": args.workdir,
            "commit": git_commit(), "rows": rows, "commands": commands, "notes": args.note,
            "paired": {"hybrid vs dense": paired(rows["hybrid"], rows["dense"],
                                                 ("em@1", "top1", "top20")),
                       "hybrid vs bm25": paired(rows["hybrid"], rows["bm25"], ("top1", "top20")),
                       f"hybrid vs {PASSAGE_ONLY}": paired(rows["hybrid"], rows[PASSAGE_ONLY],
                                                            ("em@1", "top1", "top20"))}}
  if sample:  # the other rows on the readers' sample, like for like
    result["reader_sample"] = {"questions": len(sample), "seed": readers.get("sample_seed"),
                               "rows": {name: on_rows(rows[name], sample)
                                        for name in ("dense", "hybrid", "bm25")}}
  hybrid = on_rows(rows["hybrid"], sample) if sample else rows["hybrid"]
  for name in rows:
    if is_reader(name):
      result["paired"][f"{name} vs hybrid"] = paired(rows[name], hybrid, ("em@1",))
  if args.reader_json:
    check_hybrid_weight(args.reader_json, readers, rows["hybrid"])
  from experiments.report import elide_notes, save_results
  save_results(args.out, result, table, "experiments/benchmarks/hybrid.py",
               elide_notes(sys.argv[1:] if argv is None else argv))
  return 0


if __name__ == "__main__":
  sys.exit(main())
