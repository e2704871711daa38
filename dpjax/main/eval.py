"""`run.py eval`: the evaluation questions answered open-domain; EM@k / F1@k of the top-10 phrases
and passage Top-k / MRR / P@k, written with the predictions and a TREC run file to
workdir/open_eval_<index>[_<checkpoint>].json (`_write_eval` names the files).
"""
from __future__ import annotations

import json
import logging
import pathlib
import time

from dpjax.data.questions import read_questions
from dpjax.data.squad import load_json
from dpjax.errors import DataError
from dpjax.index.evaluate import (RETRIEVAL_PARTS, found_scores, retrieve_texts,
                                   score_requests, write_trec)
from dpjax.index.faiss_index import index_folder
from dpjax.io import write_json, write_lines_atomic
from dpjax.parallel import compile_stats
from dpjax.workdir import Workdir
from dpjax.reading import Reader, check_reader_config, read_answers
from dpjax.loading import data_paths, reread_scorer
from dpjax.main import open_searcher
from dpjax.config import DEFAULT_NPROBE, SAVED_CONFIG, workdir_config
from dpjax.settings import DataSettings, EvalSettings, IndexSettings, ModelSettings, Settings

log = logging.getLogger(__name__)


def run(settings: Settings, workdir: str) -> dict:
  """`run.py eval`: the evaluation questions answered over the workdir's index; EM@k / F1@k of
  the top-10 phrases and passage Top-k / MRR / P@k (from one index search), written with the
  predictions to workdir/open_eval_<index>[_<checkpoint>].json."""
  workdir = Workdir(workdir)
  data, evaluation = settings.data, settings.eval
  if evaluation.reader:
    check_reader_config(data, evaluation, workdir)
  questions_file = data_paths(data, settings.index, workdir)["questions"]
  questions = read_questions(questions_file)
  if evaluation.limit:
    questions = questions[:evaluation.limit]
  searcher, step = open_searcher(settings, workdir, verify=settings.index.verify)
  index, texts = searcher.index, [q.question for q in questions]
  empty = searcher.empty_questions(texts)
  if empty:  # before any work (the encoder refuses them)
    raise DataError(f"{questions_file}: {len(empty)} questions hold no "
                    f"token, e.g. {questions[empty[0]].id} ({texts[empty[0]][:40]!r}): only "
                    "characters the tokenizer drops (control or format characters)")
  passage_k = evaluation.passage_k
  found, scores, seconds, split = _answered(searcher, questions, evaluation)
  batch64_qps, timed = _batch64_throughput(evaluation, searcher, texts)
  log.info("phrases and passages of %d questions in %.0f s; %.1f questions/s at batch 64 "
           "(top-10 phrases)", len(texts), seconds, batch64_qps)
  checkpoint = evaluation.checkpoint
  report = {"index": settings.index.search_index, "questions": len(questions),
            "checkpoint": checkpoint, "model_step": step, "fingerprint": index.fingerprint,
            **scores, "search_seconds": seconds, "search_split": split,
            "questions_per_sec_batch64": batch64_qps,
            "batch64_questions": timed, "index_tokens": index.manifest["num_tokens"],
            "dump_passages": index.dump.manifest["num_passages"],
            "dump_seconds": index.dump.manifest.get("seconds"),
            "index_build_seconds": index.manifest["build_seconds"],
            "index_spec": index.manifest["resolved_spec"],
            "index_bytes_per_token": index.manifest["index_bytes"] / index.manifest["num_tokens"],
            "merge_spans": index.merge_spans, "hybrid": _hybrid_record(index),
            "reread": index.reread.passages if index.reread else 0,
            "reread_margin": index.reread.margin if index.reread else None,
            "reread_window": index.reread.window if index.reread else None,
            "reread_scored_by": reread_scorer(evaluation, settings.index),
            "nprobe": settings.index.nprobe}
  reading = None
  if evaluation.reader:  # the retriever-reader pipeline over the ranked passages
    reader = Reader(*_reader_sections(settings), evaluation)
    report["reader"], reading = read_answers(reader, data, evaluation, workdir, searcher,
                                             questions, found[1], seconds)
  phrases = [[index.result(p) for p, _ in units] for units in found[0]]
  # eval.passage_k = 0: no passage search, an empty TREC run (not a stale one of another run)
  ranked = [[(index.dump.passages[p.passage].id, p.score) for p, _ in units]
            for units in (found[1] if passage_k else [[] for _ in questions])]
  _write_eval(evaluation, settings.index, workdir, report, questions, phrases, ranked, reading)
  return report


def _answered(searcher, questions: list, evaluation: EvalSettings
              ) -> tuple[list, dict, float, dict]:
  """(the top-10 phrases and top passage_k passages of every question, their scores, the
  seconds of both, those seconds split: waiting for the question encoder, the shared index
  search, the searches given its hits (rescoring, fusion, units, any wider index search), the
  scoring; and the compiles within them, part of those parts)."""
  texts, passage_k = [q.question for q in questions], evaluation.passage_k
  compiled, timing = compile_stats(), {}
  start = time.perf_counter()
  # Encoding and searching pipelined: the next 256 questions encoded while these are searched.
  found = retrieve_texts(searcher.index, searcher.encode, texts,
                         score_requests(passage_k=passage_k), progress=True, shared_hits=True,
                         max_answer_length=evaluation.max_answer_length, timing=timing)
  scoring = time.perf_counter()
  scores = found_scores(searcher.index, found, [q.answers for q in questions],
                        passage_k=passage_k, passage_ks=(1, 5, 20, 100), regex=evaluation.regex,
                        per_question=True)
  end, now = time.perf_counter(), compile_stats()
  split = {**{f"{part}_seconds": timing.get(part, 0.0) for part in RETRIEVAL_PARTS},
           "scoring_seconds": end - scoring,
           "compile_seconds": now["seconds"] - compiled["seconds"],
           "compiles": now["count"] - compiled["count"]}
  return found, scores, end - start, split


def _hybrid_record(index) -> dict | None:
  """What a hybrid search fused (None: dense): its weights, BM25 passages and BM25 index size."""
  if index.hybrid is None:
    return None
  manifest = index.hybrid.sparse.manifest
  return {**index.hybrid.record(), "weight_tuning": manifest.get("weight_tuning"),
          "bm25": manifest["settings"],
          "bm25_index_bytes": manifest["index_bytes"],
          "bm25_bytes_per_token": manifest["index_bytes"] / index.manifest["num_tokens"]}


def _reader_sections(settings: Settings) -> tuple[ModelSettings, DataSettings]:
  """(model, data) of `eval.reader`'s reader: those its workdir saved, else this run's."""
  reader_workdir = pathlib.Path(settings.eval.reader)
  if (reader_workdir / SAVED_CONFIG).is_file():
    settings = Settings.of(workdir_config(None, [], reader_workdir))
  return settings.model, settings.data


def _batch64_throughput(evaluation: EvalSettings, searcher,
                        texts: list[str]) -> tuple[float, int]:
  """Throughput as a service sees it: consecutive batches of 64 questions, encoding included
  (re-reading's passages encoded again: its cache emptied first)."""
  timed = texts[:max(64, evaluation.throughput_questions)]
  if searcher.index.reread is not None:
    searcher.index.reread.clear()
  start = time.perf_counter()
  for lo in range(0, len(timed), 64):
    searcher.search(timed[lo:lo + 64], k=10, unit="phrase",
                    max_answer_length=evaluation.max_answer_length)
  return len(timed) / (time.perf_counter() - start), len(timed)


def _spans(results: list[dict]) -> list[list]:
  return [[r["passage_id"], r["start_char"], r["end_char"]] for r in results]


def _name_parts(evaluation: EvalSettings, index: IndexSettings) -> tuple[str, str, str]:
  """(prefix, search, tag) of an evaluation's files, open_eval_<prefix><index><search><tag>.json:
  the dump's name unless it is the default `dump`, the search's kind, the checkpoint's name
  unless latest: another corpus, search or QSFT overwrites nothing (nprobe: `_probe`)."""
  checkpoint, dump = evaluation.checkpoint, index.dump_name
  tag = "" if checkpoint == "latest" else f"_{checkpoint}"
  prefix = "" if dump == "dump" else f"{dump}_"
  # Hybrid search's and unmerged spans' their own (and an approximate index's top-1 is compared
  # with Flat's searched the same way); hybrid weights set by hand name theirs, beside the
  # recorded ones'.
  search = (("_hybrid" if index.sparse else "") + ("" if index.merge_spans else "_unmerged")
            + (f"_reread{index.reread}" if index.reread else "")
            + ("" if index.reread_margin is None else f"_m{index.reread_margin:g}")
            + ("" if index.reread_window is None else f"_around{index.reread_window}"))
  scorer = reread_scorer(evaluation, index)
  search += "" if scorer is None else f"_scored_{scorer}"
  if index.sparse and index.sparse_weight is not None:
    search += f"_w{index.sparse_weight:g}_s{index.sparse_sentence_weight or 0.0:g}"
  return prefix, search, tag


def _probe(index: IndexSettings) -> str:
  """The name part of an approximate search's nprobe when it is not the default ("" for Flat,
  which visits every vector): an eval at another nprobe keeps its own files."""
  if index.nprobe == DEFAULT_NPROBE or index.search_index == "Flat":
    return ""
  return f"_nprobe{index.nprobe}"


def report_file(evaluation: EvalSettings, index: IndexSettings, workdir: pathlib.Path
                ) -> pathlib.Path:
  """The report `run.py eval` writes for these settings ("IVFauto,SQ4": IVFauto_SQ4's)."""
  prefix, search, tag = _name_parts(evaluation, index)
  return pathlib.Path(workdir) / (f"open_eval_{prefix}{index_folder(index.search_index)}"
                                  f"{search}{_probe(index)}{tag}.json")


def _write_eval(evaluation: EvalSettings, index: IndexSettings, workdir: pathlib.Path,
                report: dict, questions, phrases, ranked, reading=None) -> None:
  """Writes the report, the phrase predictions (JSONL) and the passage ranking (a TREC run file,
  `qid Q0 passage_id rank score dpjax`, as Pyserini writes); for an approximate index, adds how
  often its top-1 is the Flat index's (when Flat was evaluated on the same model and dump)."""
  prefix, search, tag = _name_parts(evaluation, index)
  name = prefix + index_folder(index.search_index) + search + _probe(index)
  flat_report = workdir / f"open_eval_{prefix}Flat{search}{tag}.json"
  exact = workdir / f"open_predictions_{prefix}Flat{search}{tag}.jsonl"
  if index.search_index != "Flat" and exact.is_file() and flat_report.is_file():
    same_model = ("model_step", "fingerprint", "hybrid")
    flat_model = {k: load_json(flat_report).get(k) for k in same_model}
    if flat_model == {k: report.get(k) for k in same_model}:
      flat = {r["id"]: r["spans"][:1] for r in map(json.loads, exact.open())}
      same = [flat[q.id] == _spans(r)[:1] for q, r in zip(questions, phrases)
              if q.id in flat]
      report["top1_agreement_with_flat"] = 100.0 * sum(same) / max(len(same), 1)
    else:
      log.warning("%s is of another model or dump (%s); no top-1 agreement with Flat reported",
                  flat_report, flat_model)
  write_lines_atomic(workdir / f"open_predictions_{name}{tag}.jsonl", (
      json.dumps({"id": q.id, "question": q.question, "answers": q.answers,
                  "predictions": [p["answer"] for p in r], "spans": _spans(r),
                  **({"reader_prediction": reading[i]} if reading is not None else {})})
      + "\n"
      for i, (q, r) in enumerate(zip(questions, phrases))))
  skipped = write_trec(workdir / f"open_run_{name}{tag}.trec", questions, ranked)
  if skipped:
    report["trec_run_not_written"] = skipped
  write_json(report_file(evaluation, index, workdir), report)
  # passage Top-k as far as eval.passage_k reaches (0: none)
  summary = "  ".join([f"EM@1 {report['em@1']:.2f}", f"EM@10 {report['em@10']:.2f}"] + [
      f"passage Top-{k} {report[f'top{k}']:.2f}" for k in (1, 5, 20) if f"top{k}" in report])
  log.info("open-domain (%s, %d questions): %s", name, len(questions), summary)
  print(f"open-domain {summary}  ({len(questions)} questions, index {name})")
  if "reader" in report:
    reader = report["reader"]
    print(f"reader over the top {reader['passages']} passages (mu {reader['mu']:g}): EM@1 "
          f"{reader['em@1']:.2f}  {reader['questions_per_sec']:.1f} questions/s with the search")
  for q, r in list(zip(questions, phrases))[:5]:
    print(f"  Q: {q.question}  gold: {q.answers[0]!r}  predicted: {r[0]['answer']!r}"
          if r else f"  Q: {q.question}  (no answer)")
