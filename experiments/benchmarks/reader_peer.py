"""The retriever-reader peer (SQuAD-open small): BM25's top-k passages and dpjax's top-k passages,
each read by the trained cross-encoder reader (`run.py teacher`'s model), beside dpjax's own
phrase answers, on the same questions and passages.

  python experiments/benchmarks/reader_peer.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --reader workdirs/reader --k 10 --out results/reader_peer.json

Rows (all over the passages of the workdir's dump; EM@1: SQuAD-normalised exact match of the
one answer against the gold answers, `dpjax.metrics.open_domain_scores`; passage Top-k: DPR's
`has_answer`, `dpjax.metrics.passage_scores`):
  dpjax        dpjax's top phrase (`run.py eval`'s EM@1), from the same index search as its
               passages;
  bm25+reader  BM25 (bm25s, k1 0.9, b 0.4, as `passage_retrieval.py`) top-k passages, read;
  dpjax+reader dpjax's top-k passages (a passage scores as its best phrase), read;
  ... (mixed)  the same reading, answered as BERTserini (Yang et al. 2019) does.
The reader answers with the best span (start + end logit, at most eval.max_answer_length tokens,
inside one window) over all windows of the k passages (`dpjax.reading.read_retrieved`): its score
alone, the retriever's not added. Its scores are not comparable across passages (it was trained
on windows holding the answer), so the mixed rows take each passage's best span and answer with
the one of the highest (1 - mu) x retriever score of its passage + mu x reader score
(`dpjax.reading.mixed_answers`). mu is chosen for each retriever by EM@1 from `MU_GRID` on
--tune-questions random training questions (seeded; never the reported ones: the dev split), each
mu's EM@1 recorded in the row's `mixing` (the reader and the phrase model were trained on these
questions: a caveat, as for hybrid search's weights, `dpjax.index.hybrid_weights`). "read passage
has answer" is the share of questions whose answer comes from a passage holding a gold answer (the
re-ranking of the k passages), "read from passage 1" the share read from the retriever's first
passage.
Questions/s: retrieval, reading, and the two in sequence, after a warm-up on the first
--warmup questions (compiles); a mixed row's are its reader row's (one reading); BM25's index
build is reported apart. Per-question EM@1 hits are kept for paired tests
(`dpjax.metrics.mcnemar_p`); the table gives dpjax+reader against dpjax's phrases and each mixed
row against its reader alone. Writes the JSON and a Markdown table beside it (`--out` with .md).
`--systems bm25` measures BM25's rows alone, from the corpus (no dump needed: it can run while
the phrase model trains or dumps); a later `--systems dpjax` with the same --out keeps them,
once it has checked that they read the same questions, passages (a digest) and reader.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from dpjax.reading import MU_GRID, TUNE_SEED, choose_mu, em_hits  # noqa: E402
from experiments.report import git_commit  # noqa: E402
SAMPLE_SEED = 23  # --sample's evaluation questions


def passage_ks(k: int) -> list[int]:
  """The passage Top-n reported: 1, 5 and k, none past k."""
  return sorted({n for n in (1, 5, k) if n <= k})


def system_row(passages, retrieved, predictions, answers, k: int, seconds: dict) -> dict:
  """One row's scores: EM@1 / F1@1 of the answers, the retriever's passage Top-1/5/k."""
  from dpjax import metrics
  texts = [[passages[r].text for r in rows if r >= 0] for rows in retrieved]
  row = {**metrics.open_domain_scores([[p] if p is not None else [] for p in predictions],
                                      answers, ks=(1,)),
         "passages": metrics.passage_scores(texts, answers, ks=passage_ks(k), mrr_k=k,
                                            precision_k=k),
         "hits": {"em@1": em_hits(predictions, answers)}, "seconds": seconds}
  total = sum(seconds.values())
  row["questions_per_sec"] = {name: len(answers) / s for name, s in seconds.items() if s > 0}
  row["questions_per_sec"]["pipeline"] = len(answers) / total
  return row


def read(reader, tokenizer, reader_data, evaluation, texts, passages, retrieved, mesh, batch):
  """(the reader's best span in each retrieved passage [Q][k] (`reading.read_retrieved_passages`),
  seconds), windowed as the reader's `reader_data` section says."""
  from dpjax.reading import read_retrieved_passages
  start = time.perf_counter()
  per_passage = read_retrieved_passages(reader, tokenizer, reader_data, texts, passages,
                                        retrieved, mesh=mesh, batch_size=batch,
                                        max_answer_length=evaluation.max_answer_length)
  return per_passage, time.perf_counter() - start


def read_passages(passages, found, answers) -> dict:
  """Where the reader's answers come from: the share of questions (x100) whose answer is read
  from a passage holding a gold answer, and from the retriever's first passage."""
  from dpjax import metrics
  n = max(len(answers), 1)
  return {"read_passage_has_answer": 100.0 * sum(
              a is not None and metrics.has_answer(passages[a.passage_row].text, g)
              for a, g in zip(found, answers)) / n,
          "read_from_first": 100.0 * sum(a is not None and a.rank == 0 for a in found) / n}


def reader_rows(name, passages, rows, retriever_scores, per_passage, answers, k: int,
                seconds: dict, mixing: dict) -> dict:
  """The `NAME+reader` row (the reader's score alone) and the `NAME+reader (mixed)` row (the
  retriever's and the reader's, mixed with the chosen mu): one reading, so one timing."""
  from dpjax.reading import mixed_answers, reader_answers

  def row(found):
    return {**system_row(passages, rows, [a.text if a else None for a in found], answers, k,
                         seconds), **read_passages(passages, found, answers)}
  return {f"{name}+reader": row(reader_answers(per_passage)),
          f"{name}+reader (mixed)": {**row(mixed_answers(per_passage, retriever_scores,
                                                         mixing["mu"])), "mixing": mixing}}


def dpjax_search(searcher, texts, k: int, evaluation):
  """(passage rows [Q][k], their scores [Q][k] (each its best phrase's), top phrases [Q],
  seconds) of one index search."""
  start = time.perf_counter()
  passages, phrases = searcher.search_many(texts, [(k, "passage"), (1, "phrase")],
                                           max_answer_length=evaluation.max_answer_length)
  seconds = time.perf_counter() - start
  return ([[r["passage_row"] for r in found] for found in passages],
          [[r["score"] for r in found] for found in passages],
          [found[0]["answer"] if found else None for found in phrases], seconds)


def sample_rows(count: int, sample: int) -> list[int] | None:
  """The rows (ascending) of `sample` random questions of `count` (seeded), or None for all:
  reading is slow on a CPU, and a random sample keeps the questions' mix of articles."""
  if not sample or sample >= count:
    return None
  rng = np.random.default_rng(SAMPLE_SEED)
  return sorted(int(i) for i in rng.choice(count, size=sample, replace=False))


def tuning_questions(data, workdir, limit: int) -> tuple[list, dict]:
  """`limit` random training questions (seeded; 0: all), on which mu is chosen, and a record."""
  from dpjax.data import data_files
  from dpjax.data.questions import read_questions, sample_questions
  path = data_files(data, workdir)["train"]
  questions = sample_questions(read_questions(path), limit, TUNE_SEED)
  return questions, {"file": str(path), "questions": len(questions), "seed": TUNE_SEED,
                     "grid": list(MU_GRID), "criterion": "EM@1, ties to the smaller mu"}


def corpus_passages(data, index, workdir) -> list:
  """The passages of the workdir's corpus, as `run.py dump` reads them (the dump's, in its order):
  BM25's rows need no phrase model."""
  from dpjax.data.corpus import read_corpus
  from dpjax.loading import data_paths
  return list(read_corpus(data_paths(data, index, workdir)["corpus"]))


def questions_digest(questions) -> str:
  """A SHA-256 of the questions' ids and texts, in order: rows of other questions (another
  questions file of as many) are never kept or paired with these."""
  import hashlib
  digest = hashlib.sha256()
  for q in questions:
    digest.update(json.dumps([q.id, q.question]).encode())
  return digest.hexdigest()


def passages_digest(passages) -> str:
  """A SHA-256 of the passages' ids, titles and texts: rows kept from an earlier run must have
  read the same passages."""
  import hashlib
  digest = hashlib.sha256()
  for p in passages:
    digest.update(json.dumps([p.id, p.title, p.text]).encode())
  return digest.hexdigest()


def bm25_systems(read_rows, passages, texts, answers, tune_texts, tune_answers, k: int) -> dict:
  """The BM25 reader rows (`reader_rows`), BM25's index build time in each."""
  from experiments.benchmarks.passage_retrieval import bm25_retrieve
  bm25_rows, bm25_scores, info = bm25_retrieve(passages, texts, k)
  per_passage, read_s = read_rows(texts, bm25_rows)
  tune_rows, tune_scores, _ = bm25_retrieve(passages, tune_texts, k)
  bm25 = reader_rows("bm25", passages, bm25_rows, bm25_scores, per_passage, answers, k,
                     {"retrieval": len(texts) / info["questions_per_sec"], "reading": read_s},
                     choose_mu(read_rows(tune_texts, tune_rows)[0], tune_scores, tune_answers))
  return {name: {**row, "bm25_index_seconds": info["index_seconds"]}
          for name, row in bm25.items()}


def dpjax_systems(read_rows, searcher, evaluation, index, texts, answers, tune_texts,
                  tune_answers, k: int) -> dict:
  """dpjax's phrase row and its reader rows (`reader_rows`), named `hybrid` when the config
  searches hybrid (`index.sparse`)."""
  passages = searcher.index.dump.passages
  name = "hybrid" if index.sparse else "dpjax"
  rows, scores, phrases, search_s = dpjax_search(searcher, texts, k, evaluation)
  systems = {name: system_row(passages, rows, phrases, answers, k, {"retrieval": search_s})}
  per_passage, read_s = read_rows(texts, rows)
  tune_rows, tune_scores = dpjax_search(searcher, tune_texts, k, evaluation)[:2]
  systems.update(reader_rows(name, passages, rows, scores, per_passage, answers, k,
                             {"retrieval": search_s, "reading": read_s},
                             choose_mu(read_rows(tune_texts, tune_rows)[0], tune_scores,
                                       tune_answers)))
  if index.sparse:  # the weight fused with (hybrid.py checks it is its eval's)
    for row in systems.values():
      row["hybrid"] = searcher.index.hybrid.record()
  return systems


def measure(args, settings, reader_settings, workdir) -> dict:
  """The systems' rows on the evaluation questions (`settings`: the phrase model's config's
  `Settings`, `reader_settings` the reader's), with what they were measured on."""
  from dpjax.data import Tokenizer
  from dpjax.data.questions import read_questions
  from dpjax.parallel import make_mesh, round_to_devices
  from dpjax.reading import restore_reader
  from dpjax.loading import data_paths
  from dpjax.main import open_searcher
  from dpjax.settings import section_dict

  evaluation = settings.eval
  questions = read_questions(data_paths(settings.data, settings.index, workdir)["questions"])
  questions = questions[:args.limit or evaluation.limit or None]
  question_rows = sample_rows(len(questions), args.sample)
  if question_rows is not None:
    questions = [questions[i] for i in question_rows]
  texts, answers = [q.question for q in questions], [q.answers for q in questions]
  tune, tuning = tuning_questions(settings.data, workdir, args.tune_questions)
  tune_texts, tune_answers = [q.question for q in tune], [q.answers for q in tune]
  searcher, step = (open_searcher(settings, workdir, args.index) if "dpjax" in args.systems
                    else (None, None))
  passages = (searcher.index.dump.passages if searcher
              else corpus_passages(settings.data, settings.index, workdir))
  reader, reader_step = restore_reader(reader_settings.model, args.reader)
  tokenizer = Tokenizer.from_pretrained(reader_settings.model.tokenizer)
  mesh = make_mesh()
  batch = round_to_devices(evaluation.batch_size, mesh)
  k = min(args.k, len(passages))
  read_rows = lambda texts, rows: read(reader, tokenizer, reader_settings.data, evaluation,
                                       texts, passages, rows, mesh, batch)
  warm = texts[:args.warmup]  # compiles: the searcher's and the reader's, not timed
  read_rows(warm, dpjax_search(searcher, warm, k, evaluation)[0] if searcher else
            [list(range(k))] * len(warm))
  systems = {}
  if searcher:
    systems.update(dpjax_systems(read_rows, searcher, evaluation, settings.index, texts, answers,
                                 tune_texts, tune_answers, k))
  if "bm25" in args.systems:
    systems.update(bm25_systems(read_rows, passages, texts, answers, tune_texts, tune_answers, k))
  for name, row in systems.items():
    logging.info("%s: EM@1 %.2f, passage Top-1 %.2f, %.1f questions/s%s", name, row["em@1"],
                 row["passages"]["top1"], row["questions_per_sec"]["pipeline"],
                 f", mu {row['mixing']['mu']:g}" if "mixing" in row else "")
  return {"config": args.config, "questions": len(texts), "passages": len(passages), "k": k,
          "question_rows": question_rows, "sample_seed": SAMPLE_SEED if args.sample else None,
          "passages_sha256": passages_digest(passages),
          "questions_sha256": questions_digest(questions),
          "reader_data": section_dict(reader_settings.data),
          "index": args.index or settings.index.search_index, "workdir": str(workdir),
          "model_step": step, "reader": {"workdir": args.reader, "step": reader_step,
                                         "config": args.reader_config or args.config},
          "warmup_questions": len(warm), "batch_size": batch, "tuning": tuning,
          "max_answer_length": evaluation.max_answer_length, "systems": systems}


# What rows kept from an earlier run must share with this one's.
SAME = ("config", "questions", "question_rows", "questions_sha256", "passages", "k",
        "passages_sha256", "reader", "reader_data", "tuning", "max_answer_length")
SEARCHED = ("workdir", "index", "model_step")  # the phrase model's rows: of one model and index


def with_kept_rows(results: dict, out: pathlib.Path) -> dict:
  """`results` with the rows of the systems this run did not measure kept from the JSON at
  `out` (an earlier run of the other --systems), which must have read the same questions,
  passages and reader; each run (its systems, commit, device, command) is listed under `runs`."""
  run = {"systems": sorted(results["systems"]), "commit": results["commit"],
         "device": results["device"], "command": results.get("command")}
  if not out.is_file():
    return {**results, "runs": [run]}
  old = json.loads(out.read_text())
  differ = [key for key in SAME if old.get(key) != results.get(key)]
  if differ:
    raise SystemExit(f"{out}: made with other {', '.join(differ)}; its rows cannot be kept "
                     f"(remove it, or run every system)")
  kept = {name: row for name, row in old["systems"].items() if name not in results["systems"]}
  if results["model_step"] is None:  # no searcher this run: the kept rows' model and index
    results.update({key: old.get(key) for key in SEARCHED})
  elif old.get("model_step") is not None and any(
      name.split("+")[0] in ("dpjax", "hybrid") for name in kept):
    differ = [key for key in SEARCHED if old.get(key) != results.get(key)]
    if differ:
      raise SystemExit(f"{out}: its phrase-model rows are of another {', '.join(differ)}; "
                       "they cannot stand beside these (remove it, or run every system)")
  runs = [{**r, "systems": [name for name in r["systems"] if name in kept]}
          for r in old.get("runs", [])]
  return {**results, "systems": {**kept, **results["systems"]},
          "runs": [r for r in runs if r["systems"]] + [run]}


def table(results: dict, command: str) -> str:
  from dpjax.metrics import mcnemar_p
  from experiments.report import p_text, with_notes
  k = results["k"]
  lines = ["# Retriever-reader peer", "", f"Command: `{command}`", "",
           f"{results['questions']} questions of `{results['config']}`"
           + (f" (a random sample, seed {results['sample_seed']}, rows in the JSON)"
              if results.get("question_rows") else "") + f", {results['passages']} "
           "passages (the dump's), "
           f"k = {k} passages read per question by the cross-encoder reader of "
           f"`{results['reader']['workdir']}` (step {results['reader']['step']}); phrase model "
           f"of `{results['workdir']}` (step {results['model_step']}), index "
           f"{results['index']}; commit {results['commit']}; {results['device']}.", "",
           "| system | EM@1 | F1@1 | " + " | ".join(f"passage Top-{n}" for n in passage_ks(k))
           + " | read passage has answer | read from passage 1 | retrieval q/s | reading q/s "
           "| pipeline q/s |", "|---|" + "---|" * (len(passage_ks(k)) + 7)]
  fmt = lambda value: "-" if value is None else f"{value:.2f}"
  for name, row in results["systems"].items():
    qps, p = row["questions_per_sec"], row["passages"]
    lines.append(f"| {name} | {row['em@1']:.2f} | {row['f1@1']:.2f} | "
                 + " | ".join(f"{p[f'top{n}']:.2f}" for n in passage_ks(k))
                 + f" | {fmt(row.get('read_passage_has_answer'))} | "
                 f"{fmt(row.get('read_from_first'))} | {qps['retrieval']:.1f} | "
                 + (f"{qps['reading']:.1f}" if "reading" in qps else "-")
                 + f" | {qps['pipeline']:.1f} |")
  systems = results["systems"]
  for name in ("dpjax", "hybrid"):
    if name in systems:
      a_only, b_only, p = mcnemar_p(systems[f"{name}+reader"]["hits"]["em@1"],
                                    systems[name]["hits"]["em@1"])
      lines += ["", f"EM@1, {name}+reader against {name}'s phrases: right only with the reader "
                    f"{a_only}, only without it {b_only}, McNemar p {p_text(p)}."]
  if len(results.get("runs", [])) > 1:
    lines += ["", "Measured in " + str(len(results["runs"])) + " runs: " + "; ".join(
        f"{', '.join(r['systems'])} at {r['commit']} on {r['device']}"
        + (f" by `{r['command']}`" if r.get("command") else "") for r in results["runs"])
        + "."]
  tuning = results["tuning"]
  for name, row in systems.items():
    if "mixing" in row:
      alone = name.removesuffix(" (mixed)")
      a_only, b_only, p = mcnemar_p(row["hits"]["em@1"], systems[alone]["hits"]["em@1"])
      mu, em = row["mixing"]["mu"], row["mixing"]["em@1"]  # every mu's EM@1 is in the JSON
      there = lambda at: fmt(em.get(str(at)))
      lines += ["", f"{name}: mu {mu:g}, chosen on {tuning['questions']} training questions "
                    f"(EM@1 there {there(mu)}; retriever alone, mu 0: {there(0.0)}; reader "
                    f"alone, mu 1: {there(1.0)}). EM@1 against {alone}: right only mixed "
                    f"{a_only}, only alone {b_only}, McNemar p {p_text(p)}."]
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="the phrase model's config")
  parser.add_argument("--workdir", required=True, help="a workdir with a dump and its index")
  parser.add_argument("--reader", required=True,
                      help="a workdir holding a `run.py teacher` reader (teacher/checkpoints)")
  parser.add_argument("--reader-config", default=None,
                      help="the reader's config (its model and windows; default: --config)")
  parser.add_argument("--k", type=int, default=10, help="passages read per question")
  parser.add_argument("--limit", type=int, default=0,
                      help="the first N questions (default: eval.limit, 0: all)")
  parser.add_argument("--sample", type=int, default=0,
                      help="N random questions of them (seeded; 0: all); their rows are recorded")
  parser.add_argument("--index", default=None, help="default: index.search_index")
  parser.add_argument("--warmup", type=int, default=64, help="untimed questions first")
  parser.add_argument("--tune-questions", type=int, default=500,
                      help="random training questions mu is chosen on (0: all of them)")
  parser.add_argument("--systems", default="dpjax,bm25",
                      help="the retrievers measured (dpjax, bm25 or both; dpjax's rows are named "
                      "hybrid with --set index.sparse=True); a run keeps the rows it does not "
                      "measure from --out (BM25's need no dump: they can run first)")
  parser.add_argument("--out", required=True)
  parser.add_argument("--set", action="append", default=[], help="overrides of --config")
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph under the table")
  args = parser.parse_args(argv)
  args.systems = set(args.systems.split(","))
  if not args.systems or args.systems - {"dpjax", "bm25"}:
    parser.error(f"--systems {','.join(sorted(args.systems))}: dpjax, bm25 or dpjax,bm25")
  if args.sample < 0:
    parser.error(f"--sample {args.sample}: a number of questions (0: all)")
  if args.k < 1:
    parser.error(f"--k {args.k}: read at least one passage")
  from experiments.report import command_line, elide_notes, save_results
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  from dpjax.config import load_config, setup_logging
  setup_logging("dpjax.checkpoint", fmt="%(asctime)s %(message)s")
  import jax
  from dpjax.settings import Settings
  settings = Settings.of(load_config(args.config, args.set))
  reader_settings = (Settings.of(load_config(args.reader_config)) if args.reader_config
                     else settings)
  results = measure(args, settings, reader_settings, pathlib.Path(args.workdir))
  results.update(commit=git_commit(), notes=args.note,
                 device=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                 command=command_line("experiments/benchmarks/reader_peer.py", argv))
  results = with_kept_rows(results, pathlib.Path(args.out))
  save_results(args.out, results, table, "experiments/benchmarks/reader_peer.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
