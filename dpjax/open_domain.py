"""Open-domain pipeline behind `run.py dump | index | search | eval`.

  dump    encode every passage of the corpus with the trained phrase encoder (workdir/dump)
  index   build the configured faiss indexes over the dump (workdir/dump/indexes/<name>)
  search  answer questions given on the command line
  eval    answer the evaluation questions open-domain; EM@k/F1@k (phrases) and passage
          Top-k / MRR@20 / P@20, written to workdir/open_eval_<index>.json with predictions
"""
from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Sequence

import jax
from flax import nnx

from dpjax import metrics
from dpjax.data.squad import DataError, load_json, read_squad

log = logging.getLogger(__name__)


def restore_model(config, workdir: pathlib.Path):
  """The configured model with the parameters of the latest checkpoint in `workdir`."""
  from dpjax.checkpoint import Checkpointer, abstract_like
  from dpjax.models import create_model
  from dpjax.parallel import make_mesh
  from dpjax.train import init_state, make_optimizer

  model = create_model(config.model)
  checkpoints = workdir / "checkpoints"
  if not checkpoints.is_dir():
    log.warning("%s has no checkpoints: using the untrained %s weights", workdir,
                config.model.name if config.model.init == "pretrained" else "random")
    return model, None
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tx, _, _ = make_optimizer(config.train, params, 1)  # the state's structure, for restoring
  _, state, _ = init_state(model, tx, prebatch_size=config.train.loss.prebatch_size,
                           batch_size=config.train.batch_size,
                           length=config.data.max_seq_length, seed=0, mesh=make_mesh())
  checkpointer = Checkpointer(checkpoints)
  restored = checkpointer.restore(abstract_like(state))
  checkpointer.close()
  if restored is None:
    raise DataError(f"{checkpoints}: no complete checkpoint to load")
  nnx.update(model, jax.device_get(restored[0].params))
  return model, int(restored[0].step)


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
      _, questions, _ = read_squad(path)
      return [{"id": q.id, "question": q.question, "answers": q.answers} for q in questions]
  questions = []
  for i, row in enumerate(rows):
    answers = row.get("answers") if isinstance(row, dict) else None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not answers:
      raise DataError(f"{path}: record {i} needs 'question' and a non-empty 'answers' list")
    questions.append({"id": str(row.get("id", i)), "question": row["question"],
                      "answers": [a if isinstance(a, str) else a.get("text", "") for a in answers]})
  return questions


def _paths(config, workdir: pathlib.Path) -> dict:
  from dpjax.data import data_files
  files = data_files(config.data, workdir)
  # Default corpus: the data set's own (synthetic: corpus.json; SQuAD: train + dev paragraphs).
  corpus = list(config.index.corpus) or [str(files[k]) for k in ("corpus",) if k in files] or [
      str(files["train"]), str(files["dev"])]
  questions = config.index.questions or str(files["dev"])
  return {"corpus": corpus, "questions": questions, "dump": workdir / config.index.dump_name}


def run_dump(config, workdir: str) -> dict:
  from dpjax.corpus import read_corpus
  from dpjax.data import SkipSummary, Tokenizer
  from dpjax.index.dump import DumpConfig, dump_phrases
  from dpjax.parallel import make_mesh, round_to_devices

  workdir = pathlib.Path(workdir)
  paths = _paths(config, workdir)
  model, step = restore_model(config, workdir)
  mesh = make_mesh()
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
                      nprobe=config.index.nprobe) for spec in config.index.specs]


def _searcher(config, workdir: pathlib.Path, index_name: str):
  from dpjax.data import Tokenizer
  from dpjax.search import DensePhrases, PhraseIndex
  model, _ = restore_model(config, workdir)
  index = PhraseIndex(workdir / config.index.dump_name, index_name, nprobe=config.index.nprobe)
  return DensePhrases(model, index, Tokenizer.from_pretrained(config.model.tokenizer),
                      max_query_length=config.data.max_query_length,
                      batch_size=config.index.batch_size)


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
  paths = _paths(config, workdir)
  questions = read_questions(paths["questions"])
  if config.eval.limit:
    questions = questions[:config.eval.limit]
  searcher = _searcher(config, workdir, config.index.search_index)
  texts = [q["question"] for q in questions]
  golds = [q["answers"] for q in questions]
  kwargs = dict(max_answer_length=config.eval.max_answer_length)
  start = time.perf_counter()
  phrases = searcher.search(texts, k=10, unit="phrase", **kwargs)
  seconds = time.perf_counter() - start
  passages = searcher.search(texts, k=100, unit="passage", **kwargs)
  report = {"index": config.index.search_index, "questions": len(questions),
            **metrics.open_domain_scores([[p["answer"] for p in r] for r in phrases], golds),
            **metrics.passage_scores([[p["passage"] for p in r] for r in passages], golds),
            "phrase_search_questions_per_sec": len(questions) / seconds,
            "index_tokens": searcher.index.manifest["num_tokens"],
            "dump_passages": searcher.index.dump.manifest["num_passages"],
            "dump_seconds": searcher.index.dump.manifest.get("seconds"),
            "index_build_seconds": searcher.index.manifest["build_seconds"],
            "index_spec": searcher.index.manifest["resolved_spec"],
            "index_bytes_per_token": searcher.index.manifest["index_bytes"] /
            searcher.index.manifest["num_tokens"]}
  name = config.index.search_index
  exact = workdir / "open_predictions_Flat.jsonl"
  if name != "Flat" and exact.is_file():  # how often the approximate index's top-1 is Flat's
    flat = {r["id"]: r["spans"][:1] for r in map(json.loads, exact.open())}
    same = [flat[q["id"]] == _spans(r)[:1] for q, r in zip(questions, phrases) if q["id"] in flat]
    report["top1_agreement_with_flat"] = 100.0 * sum(same) / max(len(same), 1)
  (workdir / f"open_eval_{name}.json").write_text(json.dumps(report, indent=1))
  with (workdir / f"open_predictions_{name}.jsonl").open("w") as f:
    for q, r in zip(questions, phrases):
      f.write(json.dumps({"id": q["id"], "question": q["question"], "answers": q["answers"],
                          "predictions": [p["answer"] for p in r], "spans": _spans(r)}) + "\n")
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
