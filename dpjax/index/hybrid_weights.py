"""Hybrid search's BM25 index and weight (`run.py index` with `index.sparse`).

The BM25 index of the dump's passages is built beside the faiss indexes (`dpjax.index.sparse`).
Without `index.sparse_weight`, the weights of passage and sentence BM25 are chosen on questions
the evaluation never reports: a seeded sample of `index.sparse_tune_questions` training questions
(their passages are in the corpus of SQuAD-open; another corpus names its own with
`index.sparse_tune_file`). Each pair of the grid is scored on them by phrase EM@1 and passage
Top-1 (one index search shared by all pairs), the pair with the best mean is recorded in the
BM25 index's manifest with every pair's scores; ties go to the smaller weights. A later
`run.py index` keeps it unless the settings it was chosen for (`_tuned_for`) changed.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import pathlib

from dpjax.data import data_files
from dpjax.data.questions import read_questions, sample_questions
from dpjax.errors import ConfigError
from dpjax.index.dump_reader import Dump
from dpjax.index.evaluate import PROGRESS_CHUNK, found_scores, score_requests
from dpjax.index.hybrid import Hybrid
from dpjax.index.sparse import (MANIFEST, SparseIndex, build_sparse, record_weight,
                                sparse_folder)
from dpjax.settings import DataSettings, EvalSettings, IndexSettings, ModelSettings
from dpjax.workdir import Workdir
from dpjax.loading import load_searcher

log = logging.getLogger(__name__)

WEIGHTS = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # passage BM25's grid
SENTENCE_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0)  # sentence BM25's grid
TUNE_SEED = 17  # the training questions' sample (the evaluation's questions are the dev split)
# `_tuned_for`'s settings that weights chosen before them were chosen at (none re-read).
_TUNED_BEFORE = {"reread": 0, "reread_margin": None, "reread_window": None}


def build_sparse_index(model: ModelSettings, data: DataSettings, evaluation: EvalSettings,
                       index: IndexSettings, workdir: pathlib.Path, *,
                       best_metric: str = "em@1") -> pathlib.Path:
  """Builds the dump's BM25 index (kept if already built from this dump) and, unless
  `index.sparse_weight` is set, chooses and records its weights. The dump is loaded once: by the
  searcher the weight is chosen with when it must be, else alone. `best_metric`: which
  checkpoint `eval.checkpoint=best` is (`loading.restore_model`)."""
  workdir = Workdir(workdir)
  searcher = step = None
  if index.sparse_weight is None and not _weight_kept(evaluation, index, workdir):
    searcher, step = _dense_searcher(model, data, evaluation, index, workdir, best_metric)
  dump = searcher.index.dump if searcher else Dump.load(workdir.dump(index.dump_name),
                                                        tokens=False)  # (its passages only)
  folder = build_sparse(dump.directory, dump.passages, dump.manifest)
  sparse = SparseIndex(dump.directory, dump.manifest)
  if index.sparse_weight is not None:
    sentence = index.sparse_sentence_weight or 0.0
    record_weight(dump.directory, index.sparse_weight, sentence, {"set": "index.sparse_weight"})
    log.info("hybrid weights %g, sentence %g (index.sparse_weight)", index.sparse_weight,
             sentence)
  elif searcher or not _weight_kept(evaluation, index, workdir):  # (a rebuilt index: no weight)
    if searcher is None:
      searcher, step = _dense_searcher(model, data, evaluation, index, workdir, best_metric)
    record_weight(dump.directory,
                  *choose_weight(data, evaluation, index, workdir, searcher, step, sparse))
  else:
    log.info("hybrid weights %g, sentence %g, recorded in %s", sparse.weight,
             sparse.sentence_weight, folder)
  return folder


def _weight_kept(evaluation: EvalSettings, index: IndexSettings, workdir: Workdir) -> bool:
  """Whether the BM25 index records a weight chosen for these settings (`_tuned_for`)."""
  path = sparse_folder(workdir.dump(index.dump_name)) / MANIFEST
  try:
    manifest = json.loads(path.read_text())
  except (OSError, ValueError):  # none, or unreadable: built (again) below
    return False
  tuning = manifest.get("weight_tuning") or {}
  wanted = _tuned_for(evaluation, index)
  return (manifest.get("weight") is not None and manifest.get("sentence_weight") is not None
          and wanted == {k: tuning.get(k, _TUNED_BEFORE.get(k)) for k in wanted})


def _dense_searcher(model: ModelSettings, data: DataSettings, evaluation: EvalSettings,
                    index: IndexSettings, workdir: Workdir, best_metric: str):
  """(the workdir's searcher without hybrid search, its step): weights are set one by one."""
  return load_searcher(model, data, evaluation, dataclasses.replace(index, sparse=False),
                       workdir, best_metric=best_metric)


def _tuned_for(evaluation: EvalSettings, index: IndexSettings) -> dict:
  """The settings a chosen weight holds for: another of them chooses it again (the checkpoint
  too: a weight chosen with a model's question encoders is kept for its QSFT ones only by
  choosing it again with them)."""
  return {"passages": index.sparse_passages, "index": index.search_index,
          "checkpoint": evaluation.checkpoint,
          "limit": index.sparse_tune_questions, "tune_file": index.sparse_tune_file,
          "regex": evaluation.regex, "reread": index.reread,
          "reread_margin": index.reread_margin, "reread_window": index.reread_window}


def tune_questions(data: DataSettings, index: IndexSettings,
                   workdir: pathlib.Path) -> tuple[list, str]:
  """The held-out questions the weight is chosen on, and their file."""
  path = index.sparse_tune_file
  if not path:
    files = data_files(data, workdir)
    if "train" not in files:
      raise ConfigError("index.sparse: no training questions to choose the weight on; set "
                        "index.sparse_weight or index.sparse_tune_file")
    path = str(files["train"])
  questions = sample_questions(read_questions(path), index.sparse_tune_questions, TUNE_SEED)
  return questions, path


def choose_weight(data: DataSettings, evaluation: EvalSettings, index: IndexSettings,
                  workdir: pathlib.Path, searcher, step, sparse: SparseIndex,
                  ) -> tuple[float, float, dict]:
  """(the weights of `WEIGHTS` x `SENTENCE_WEIGHTS` with the best mean of EM@1 and passage
  Top-1 on the held-out questions, a record of how they were chosen, scores by "weight,sentence
  weight"), searched by `searcher` (dense: `_dense_searcher`) with the BM25 index `sparse`."""
  questions, path = tune_questions(data, index, workdir)
  scores = _grid_scores(evaluation, index, searcher, sparse, questions)
  for key, value in scores.items():
    log.info("hybrid weights %s, sentence %s: %s", *key.split(","), value)
  best = max(itertools.product(WEIGHTS, SENTENCE_WEIGHTS), key=lambda pair: (  # (rounded: ties)
      round(scores[pair_key(*pair)]["em@1"] + scores[pair_key(*pair)]["top1"], 6),
      -pair[0], -pair[1]))
  log.info("hybrid weights %g, sentence %g chosen on %d questions of %s", *best,
           len(questions), path)
  return *best, {"questions": len(questions), "file": path, "seed": TUNE_SEED,
                "criterion": "mean of EM@1 and passage Top-1", "model_step": step,
                **_tuned_for(evaluation, index), "scores": scores}


def _grid_scores(evaluation: EvalSettings, index: IndexSettings, searcher, sparse: SparseIndex,
                 questions) -> dict:
  """{`pair_key`: EM@1, EM@10, passage Top-1 and Top-20 of `questions`} over the grid, chunk
  by chunk of questions: a chunk's index hits, BM25 scores, BM25 passages' spans and sentence
  scores (each candidate passage's once) are computed once for every pair (the index keeps the
  last questions' lexical results), and only the scores are kept (each a mean over questions: chunks add up weighted by their size)."""
  phrase_index = searcher.index
  texts, answers = [q.question for q in questions], [q.answers for q in questions]
  q_start, q_end = searcher.encode(texts)
  requests, keys = score_requests(passage_k=20), ("em@1", "em@10", "top1", "top20")
  width = max(phrase_index.fetch_bounds(k)[unit != "phrase"] for k, unit in requests)
  grid = list(itertools.product(WEIGHTS, SENTENCE_WEIGHTS))
  sums = {pair: dict.fromkeys(keys, 0.0) for pair in grid}
  # One searcher per pair, sharing the index, its rescoring and the last lexical results.
  searchers = {pair: phrase_index.with_options(hybrid=Hybrid(sparse, *pair,
                                                             index.sparse_passages))
               for pair in grid}
  lexical = phrase_index.with_options(hybrid=Hybrid(sparse, 1.0, 0.0, index.sparse_passages))
  chunk = min(PROGRESS_CHUNK, lexical.lexical_rows())  # what one search scores with BM25 at once
  for lo in range(0, len(texts), chunk):
    rows = slice(lo, lo + chunk)
    hits = phrase_index.hits(q_start[rows], q_end[rows], width)
    for pair in grid:
      found = [searchers[pair].search(q_start[rows], q_end[rows], k, unit, hits=hits,
                                      texts=texts[rows],
                                      max_answer_length=evaluation.max_answer_length)
               for k, unit in requests]
      report = found_scores(phrase_index, found, answers[rows], passage_k=20,
                            passage_ks=(1, 5, 20), regex=evaluation.regex)
      for key in keys:
        sums[pair][key] += report[key] * len(found[0])
    log.info("hybrid weights: %d of %d questions searched", min(lo + chunk, len(texts)),
             len(texts))
  return {pair_key(*pair): {key: round(total / max(len(texts), 1), 6)
                            for key, total in sums[pair].items()} for pair in grid}


def pair_key(weight: float, sentence_weight: float) -> str:
  """The key of a pair of weights in the recorded scores: "weight,sentence weight"."""
  return f"{weight:g},{sentence_weight:g}"
