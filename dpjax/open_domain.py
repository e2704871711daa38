"""Open-domain pipeline behind `run.py dump | index | search | eval`.

  dump    encode every passage of the corpus with the trained phrase encoder (workdir/dump)
  index   build the configured faiss indexes over the dump (workdir/dump/indexes/<name>)
  search  answer questions given on the command line
  eval    answer the evaluation questions open-domain; EM@k/F1@k (phrases) and passage
          Top-k / MRR@20 / P@20, written to workdir/open_eval_<index>.json with predictions
          (open_eval_<index>_<checkpoint>.json for eval.checkpoint other than latest)
"""
from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from dpjax import metrics
from dpjax.config import write_json, write_text_atomic
from dpjax.data.squad import DataError, load_json, read_squad

log = logging.getLogger(__name__)


def restore_model(config, workdir: pathlib.Path, step: int | None = None):
  """The configured model with the parameters of the latest checkpoint in `workdir` (or of the
  best one by validation, `eval.checkpoint=best`, or of checkpoint `step`)."""
  from dpjax.checkpoint import Checkpointer, abstract_like
  from dpjax.models import create_model
  from dpjax.parallel import make_mesh
  from dpjax.train import init_state, make_optimizer

  model = create_model(config.model)
  which = config.eval.get("checkpoint", "latest")
  folders = {"latest": "checkpoints", "best": "checkpoints_best", "qsft": "checkpoints_qsft"}
  if which not in folders:
    raise ValueError(f"eval.checkpoint must be one of {sorted(folders)}, not {which!r}")
  checkpoints = workdir / folders[which]
  if which != "latest" and not checkpoints.is_dir():
    raise DataError(f"{checkpoints}: no {which} checkpoint (train with validation.every_steps, "
                    "or run `run.py qsft`)")
  if not checkpoints.is_dir():
    log.warning("%s has no checkpoints: using the untrained %s weights", workdir,
                config.model.name if config.model.init == "pretrained" else "random")
    return model, None
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tc = config.train
  shape = dict(prebatch_size=tc.loss.prebatch_size, batch_size=tc.batch_size,
               length=config.data.max_seq_length)
  if which == "qsft":  # the QSFT state: its own freezing (optimizer state) and no queue
    tc = tc.copy_and_resolve_references()
    tc.freeze = list(config.qsft.freeze)
    shape = dict(prebatch_size=0, batch_size=config.qsft.batch_size, length=1)
  tx, _, _ = make_optimizer(tc, params, 1)  # the state's structure, for restoring
  _, state, _ = init_state(model, tx, seed=0, mesh=make_mesh(), **shape)
  checkpointer = Checkpointer(checkpoints)
  if step is not None and step not in checkpointer.manager.all_steps():
    checkpointer.close()
    raise DataError(f"{checkpoints}: no checkpoint of step {step} "
                    f"(there are {sorted(checkpointer.manager.all_steps())})")
  restored = checkpointer.restore(abstract_like(state), step)  # the best dir keeps only the best
  checkpointer.close()
  if restored is None:
    raise DataError(f"{checkpoints}: no complete checkpoint to load")
  nnx.update(model, jax.device_get(restored[0].params))
  return model, int(restored[0].step)


def sample_questions(questions: list[dict], limit: int, seed: int) -> list[dict]:
  """`limit` questions drawn at random (seeded, file order kept); all of them when limit is 0.

  The first N questions of a SQuAD file come from a handful of articles: a sample is not."""
  if not limit or limit >= len(questions):
    return questions
  rows = np.sort(np.random.default_rng(seed).choice(len(questions), limit, replace=False))
  return [questions[i] for i in rows]


def read_questions(path: str | pathlib.Path) -> list[dict]:
  """Questions with answers from SQuAD JSON, open-QA JSON (`{"data": [{id, question, answers}]}`)
  or JSONL (`{"id", "question", "answers"}` per line). Returns [{id, question, answers}]."""
  path = pathlib.Path(path)
  if path.suffix == ".jsonl":
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{number}: invalid JSON at column {e.colno}: {e.msg}") from None
  else:
    root = load_json(path)
    rows = root.get("data") if isinstance(root, dict) else None
    if not isinstance(rows, list):
      raise DataError(f"{path}: expected a 'data' list")
    if rows and isinstance(rows[0], dict) and "paragraphs" in rows[0]:  # SQuAD format
      passages, questions, _ = read_squad(path)
      return [{"id": q.id, "question": q.question, "answers": q.answers,
               "title": passages[q.passage_index].title} for q in questions]
  questions = []
  for i, row in enumerate(rows):
    answers = row.get("answers") if isinstance(row, dict) else None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not answers:
      raise DataError(f"{path}: record {i} needs 'question' and a non-empty 'answers' list")
    questions.append({"id": str(row.get("id", i)), "question": row["question"],
                      "answers": [a if isinstance(a, str) else a.get("text", "") for a in answers]})
  return questions


def data_paths(config, workdir: pathlib.Path) -> dict:
  from dpjax.data import data_files
  files = data_files(config.data, workdir)
  # Default corpus: the data set's own (synthetic: corpus.json; SQuAD: train + dev paragraphs).
  corpus = list(config.index.corpus) or [str(files[k]) for k in ("corpus",) if k in files] or [
      str(files["train"]), str(files["dev"])]
  questions = config.index.questions or str(files["dev"])
  return {"corpus": corpus, "questions": questions, "dump": workdir / config.index.dump_name}


def open_workdir(config_spec: str, workdir: str | pathlib.Path, overrides: Sequence[str] = ()):
  """What analysis code starts from: `(config, workdir, dump, questions)` of a workdir that has
  a complete dump (notebooks, `experiments/benchmarks/*`)."""
  from dpjax.config import load_config
  from dpjax.index.dump import Dump
  config = load_config(config_spec, overrides)
  workdir = pathlib.Path(workdir)
  paths = data_paths(config, workdir)
  return config, workdir, Dump.load(paths["dump"]), read_questions(paths["questions"])


def run_dump(config, workdir: str) -> dict:
  from dpjax.corpus import read_corpus
  from dpjax.data import SkipSummary, Tokenizer
  from dpjax.index.dump import DumpConfig, dump_phrases
  from dpjax.parallel import make_mesh, round_to_devices

  workdir = pathlib.Path(workdir)
  paths = data_paths(config, workdir)
  model, step = restore_model(config, workdir)
  from dpjax.token_filter import apply_saved_head
  apply_saved_head(model, workdir)  # a separately trained token filter, if `run.py filter` ran
  mesh = make_mesh(local=True)  # each process encodes its own shards on its own devices
  dump_config = DumpConfig(max_seq_length=config.data.max_seq_length,
                           doc_stride=config.data.doc_stride,
                           include_title=config.data.include_title,
                           batch_size=round_to_devices(config.index.batch_size, mesh),
                           shard_passages=config.index.shard_passages)
  summary = SkipSummary()
  manifest = dump_phrases(model, Tokenizer.from_pretrained(config.model.tokenizer),
                          read_corpus(paths["corpus"], summary), paths["dump"], dump_config,
                          mesh=mesh, model_info={"workdir": str(workdir), "step": step,
                                                 "name": config.model.name})
  if summary.total:
    log.warning("%s", summary)
  log.info("dump %s: %d passages, %d tokens", paths["dump"], manifest["num_passages"],
           manifest["num_tokens"])
  return manifest


def run_index(config, workdir: str) -> list[pathlib.Path]:
  from dpjax.index.faiss_index import build_index
  dump = pathlib.Path(workdir) / config.index.dump_name
  return [build_index(dump, spec, filter_threshold=config.index.filter_threshold,
                      train_size=config.index.train_size, nprobe=config.index.nprobe)
          for spec in config.index.specs]


def _searcher(config, workdir: pathlib.Path, index_name: str, *, with_step: bool = False):
  from dpjax.data import Tokenizer
  from dpjax.search import DensePhrases, PhraseIndex
  model, step = restore_model(config, workdir)
  index = PhraseIndex(workdir / config.index.dump_name, index_name, nprobe=config.index.nprobe)
  searcher = DensePhrases(model, index, Tokenizer.from_pretrained(config.model.tokenizer),
                          max_query_length=config.data.max_query_length,
                          batch_size=config.index.batch_size)
  return (searcher, step) if with_step else searcher


def run_search(config, workdir: str, queries: Sequence[str]) -> list:
  searcher = _searcher(config, pathlib.Path(workdir), config.index.search_index)
  results = searcher.search(list(queries), k=config.index.top_k, unit=config.index.unit,
                            max_answer_length=config.eval.max_answer_length)
  for query, found in zip(queries, results):
    print(f"Q: {query}")
    for rank, r in enumerate(found, 1):
      print(f"  {rank}. {r['answer']!r} ({r['score']:.2f}) — {r['title']}: "
            f"{r.get('sentence', r['passage'])[:120]}")
  return results


def _spans(results: list[dict]) -> list[list]:
  return [[r["passage_id"], r["start_char"], r["end_char"]] for r in results]


def run_eval_open(config, workdir: str) -> dict:
  workdir = pathlib.Path(workdir)
  paths = data_paths(config, workdir)
  questions = read_questions(paths["questions"])
  if config.eval.limit:
    questions = questions[:config.eval.limit]
  searcher, step = _searcher(config, workdir, config.index.search_index, with_step=True)
  texts = [q["question"] for q in questions]
  golds = [q["answers"] for q in questions]
  kwargs = dict(max_answer_length=config.eval.max_answer_length)
  passage_k = config.eval.get("passage_k", 100)
  start = time.perf_counter()  # top-10 phrases and top passages from one index search
  phrases, passages = searcher.search_many(texts, [(10, "phrase"), (passage_k, "passage")],
                                           **kwargs)
  seconds = time.perf_counter() - start
  # Throughput as a service sees it: consecutive batches of 64 questions, encoding included.
  timed = texts[:max(64, config.eval.get("throughput_questions", 1280))]
  start = time.perf_counter()
  for lo in range(0, len(timed), 64):
    searcher.search(timed[lo:lo + 64], k=10, unit="phrase", **kwargs)
  batch64_qps = len(timed) / (time.perf_counter() - start)
  log.info("phrases and passages of %d questions in %.0f s; %.1f questions/s at batch 64 "
           "(top-10 phrases)", len(texts), seconds, batch64_qps)
  checkpoint = config.eval.checkpoint
  report = {"index": config.index.search_index, "questions": len(questions),
            "checkpoint": checkpoint, "model_step": step,
            "fingerprint": searcher.index.fingerprint,
            **metrics.open_domain_scores([[p["answer"] for p in r] for r in phrases], golds),
            **metrics.passage_scores([[p["passage"] for p in r] for r in passages], golds,
                                     ks=[k for k in (1, 5, 20, 100) if k <= passage_k]),
            "search_seconds": seconds,
            "questions_per_sec_batch64": batch64_qps, "batch64_questions": len(timed),
            "index_tokens": searcher.index.manifest["num_tokens"],
            "dump_passages": searcher.index.dump.manifest["num_passages"],
            "dump_seconds": searcher.index.dump.manifest.get("seconds"),
            "index_build_seconds": searcher.index.manifest["build_seconds"],
            "index_spec": searcher.index.manifest["resolved_spec"],
            "index_bytes_per_token": searcher.index.manifest["index_bytes"] /
            searcher.index.manifest["num_tokens"]}
  # Files of the latest checkpoint are open_eval_<index>.json; of another (eval.checkpoint=best,
  # qsft, a step) open_eval_<index>_<checkpoint>.json: evaluating QSFT overwrites nothing.
  name = config.index.search_index
  tag = "" if checkpoint == "latest" else f"_{checkpoint}"
  flat_report = workdir / f"open_eval_Flat{tag}.json"
  exact = workdir / f"open_predictions_Flat{tag}.jsonl"
  if name != "Flat" and exact.is_file() and flat_report.is_file():
    flat_model = {k: load_json(flat_report).get(k) for k in ("model_step", "fingerprint")}
    if flat_model == {"model_step": step, "fingerprint": searcher.index.fingerprint}:
      # How often the approximate index's top-1 is Flat's.
      flat = {r["id"]: r["spans"][:1] for r in map(json.loads, exact.open())}
      same = [flat[q["id"]] == _spans(r)[:1] for q, r in zip(questions, phrases)
              if q["id"] in flat]
      report["top1_agreement_with_flat"] = 100.0 * sum(same) / max(len(same), 1)
    else:
      log.warning("%s is of another model or dump (%s); no top-1 agreement with Flat reported",
                  flat_report, flat_model)
  write_text_atomic(workdir / f"open_predictions_{name}{tag}.jsonl", "".join(
      json.dumps({"id": q["id"], "question": q["question"], "answers": q["answers"],
                  "predictions": [p["answer"] for p in r], "spans": _spans(r)}) + "\n"
      for q, r in zip(questions, phrases)))
  write_json(workdir / f"open_eval_{name}{tag}.json", report)
  log.info("open-domain (%s, %d questions): EM@1 %.2f EM@10 %.2f; passage top1 %.2f top20 %.2f",
           name, len(questions), report["em@1"], report["em@10"], report["top1"],
           report["top20"])
  print(f"open-domain EM@1 {report['em@1']:.2f}  EM@10 {report['em@10']:.2f}  "
        f"passage Top-1 {report['top1']:.2f}  Top-20 {report['top20']:.2f}  "
        f"({len(questions)} questions, index {name})")
  for q, r in list(zip(questions, phrases))[:5]:
    print(f"  Q: {q['question']}  gold: {q['answers'][0]!r}  predicted: {r[0]['answer']!r}"
          if r else f"  Q: {q['question']}  (no answer)")
  return report


def run_subcorpus(config, workdir: str) -> dict:
  """Writes the validation subcorpora `validation.kinds` (C0, R<r>, H<k>, full) of the corpus to
  workdir/subcorpora/<kind>.jsonl with their metadata; H_k uses the model and the full index."""
  from dpjax.corpus import read_corpus
  from dpjax.data import SkipSummary
  from dpjax.data.squad import write_squad_subset
  from dpjax.index.dump import MANIFEST, Dump
  from dpjax import validation

  kinds = list(config.validation.kinds)
  hard_ks = [int(v) for n, v in map(validation.parse_kind, kinds) if n == "H"]
  workdir = pathlib.Path(workdir)
  paths = data_paths(config, workdir)
  out = workdir / "subcorpora"
  questions_file = paths["questions"]
  if config.validation.sample_questions:
    # A seeded random sample of the dev questions (the first N come from a few articles only).
    sample = sample_questions(read_questions(questions_file), config.validation.sample_questions,
                              config.validation.seed)
    questions_file = str(out / "questions.json")
    write_squad_subset(paths["questions"], questions_file, [q["id"] for q in sample])
  summary = SkipSummary()
  corpus = list(read_corpus(paths["corpus"], summary))
  c0 = validation.gold_rows(corpus, questions_file)
  dump = Dump.load(paths["dump"]) if (paths["dump"] / MANIFEST).is_file() else None
  if dump is not None and [p.id for p in dump.passages] != [p.id for p in corpus]:
    raise DataError(f"{paths['dump']} is not a dump of the configured corpus "
                    f"({len(dump.passages)} vs {len(corpus)} passages, or another order)")
  retrieved, provenance = None, {"corpus": paths["corpus"], "questions": questions_file,
                                 "sample_questions": config.validation.sample_questions,
                                 "seed": config.validation.seed}
  if hard_ks:
    if dump is None:
      raise DataError(f"H_k needs the full dump and index of the corpus in {paths['dump']} "
                      "(run `run.py dump` and `run.py index` first)")
    searcher = _searcher(config, workdir, config.index.search_index)
    texts = [q["question"] for q in read_questions(questions_file)]
    found = searcher.search(texts, k=max(hard_ks), unit="phrase",
                            max_answer_length=config.eval.max_answer_length)
    retrieved = [[r["passage_row"] for r in results] for results in found]
    provenance.update(index=config.index.search_index,
                      model_step=searcher.index.dump.manifest["model"].get("step"),
                      fingerprint=searcher.index.fingerprint)
  written = {}
  for kind in kinds:
    rows = validation.select(kind, len(corpus), c0, retrieved, config.validation.seed)
    meta = {"kind": kind, **provenance}
    if dump is not None:
      meta["tokens"] = validation.subcorpus_tokens(dump.token_passage, rows)
    written[kind] = validation.write_subcorpus(out / f"{kind}.jsonl", corpus, rows, meta)
    print(f"{kind}: {written[kind]['passages']} passages"
          + (f", {meta['tokens']} tokens" if "tokens" in meta else "") + f" -> {out / kind}.jsonl")
  return written


def run_mine(config, workdir: str) -> dict:
  """Mines hard negatives for the training questions with the model and its full index."""
  from dpjax.data import data_files
  from dpjax.mining import mine_hard_negatives

  workdir = pathlib.Path(workdir)
  files = data_files(config.data, workdir)
  passages, questions, _ = read_squad(files["train"])
  if config.mine.limit:
    questions = questions[:config.mine.limit]
  searcher = _searcher(config, workdir, config.index.search_index)
  out = workdir / config.mine.out
  counts = mine_hard_negatives(searcher, questions, passages, out, top_k=config.mine.top_k,
                               max_answer_length=config.eval.max_answer_length)
  print(f"hard negatives of {counts['questions']} questions -> {out}: "
        f"{counts['negatives'] / max(counts['questions'], 1):.1f} per question, "
        f"{counts['with_negatives']} questions with at least one, "
        f"{counts['dropped_with_answer']} retrieved passages dropped (they contain an answer)")
  return counts

