"""Validation on subcorpora (Kim et al. 2022, Section 4): C_0, R_r and the hard H_k.

For dev questions with gold passages (SQuAD format) and a full corpus C:
  C_0  the gold passages of the dev questions;
  R_r  C_0 plus a seeded random sample of the rest of C, up to a fraction r of |C| in all;
  H_k  C_0 plus the passages of the top-k phrases a given model retrieves from the full index
       for each dev question (the model's own hardest distractors).
Each subcorpus is written as a JSONL corpus plus `<name>.meta.json` (size, provenance).

Phrase vectors do not depend on the other passages of a corpus, so a model's accuracy on any
subcorpus can be measured on the subset of its full dump (`PhraseIndex.over_passages`) without
encoding anything again; during training, `evaluate_subcorpus` encodes a (small) subcorpus with
the current parameters, in memory, and answers the dev questions over it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Sequence

import numpy as np

from dpjax.checkpoint import Checkpointer
from dpjax.errors import ConfigError
from dpjax.data.corpus import read_corpus
from dpjax.data.questions import read_questions
from dpjax.data.squad import Passage, SkipSummary, read_squad
from dpjax.errors import DataError
from dpjax.index.dump_reader import Dump
from dpjax.index.encode import encode_shard
from dpjax.index.evaluate import METRICS, retrieval_scores
from dpjax.index.manifest import encoder_fingerprint, training_windows_config
from dpjax.index.phrase_index import PhraseIndex
from dpjax.io import read_json, write_json, write_jsonl
from dpjax.settings import DataSettings, EvalSettings, ValidationSettings
from dpjax.workdir import Workdir
from dpjax.models.encoders import bound, encode_questions
from dpjax.trainer import MetricsWriter

log = logging.getLogger(__name__)


def gold_rows(corpus: Sequence[Passage], questions_file: str | os.PathLike) -> np.ndarray:
  """Rows of `corpus` that are the gold passage (same title and text) of a dev question: of every
  question `read_questions` evaluates, those whose answer is not located in the paragraph too."""
  passages, questions, _ = read_squad(questions_file, require_answers=False)
  wanted = {(passages[q.passage_index].title, passages[q.passage_index].text)
            for q in questions if q.answers}  # (one without answer texts is not asked)
  rows = np.array([i for i, p in enumerate(corpus) if (p.title, p.text) in wanted], np.int64)
  missing = len(wanted - {(corpus[i].title, corpus[i].text) for i in rows})  # (a set: a gold
  if missing:  # passage twice in the corpus does not stand for another one missing)
    raise DataError(f"{questions_file}: {missing} of {len(wanted)} gold passages are not in the "
                    "corpus (C_0 must be part of C)")
  return rows


def random_subcorpus(num_passages: int, c0: np.ndarray, fraction: float,
                     seed: int = 0) -> np.ndarray:
  """R_r: C_0 plus a seeded random sample of the other passages, |R_r| = max(|C_0|, r |C|)."""
  if not 0 < fraction <= 1:
    raise ValueError(f"R_r needs 0 < r <= 1, got {fraction}")
  rest = np.setdiff1d(np.arange(num_passages), c0)
  extra = max(0, min(len(rest), round(fraction * num_passages) - len(c0)))
  sample = np.random.default_rng(seed).choice(rest, size=extra, replace=False)
  return np.union1d(c0, sample)


def hard_subcorpus(c0: np.ndarray, retrieved: Sequence[Sequence[int]], k: int) -> np.ndarray:
  """H_k: C_0 plus the passages of each question's top-k retrieved phrases.

  Args:
    retrieved: per dev question, the passage rows of its ranked phrases (best first).
  """
  hard = [row for ranked in retrieved for row in ranked[:k]]
  return np.union1d(c0, np.asarray(hard, np.int64))


def write_subcorpus(path: str | os.PathLike, corpus: Sequence[Passage], rows: np.ndarray,
                    provenance: dict) -> dict:
  """Writes `corpus[rows]` as JSONL and `<path stem>.meta.json`; returns the metadata."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  write_jsonl(path, (dataclasses.asdict(corpus[row]) for row in rows.tolist()))
  meta = {"passages": int(len(rows)), "corpus_passages": len(corpus), **provenance}
  write_json(path.with_suffix(".meta.json"), meta)
  return meta


def subcorpus_tokens(token_passage: np.ndarray, rows: np.ndarray) -> int:
  """Index size (tokens) of a subcorpus, from a full dump's token -> passage table."""
  return int(np.isin(token_passage, rows).sum())


def parse_kind(kind: str) -> tuple[str, float]:
  """'C0' -> ('C', 0); 'R0.1' -> ('R', 0.1); 'H8' -> ('H', 8); 'full' -> ('full', 0)."""
  if kind in ("C0", "full"):
    return ("C" if kind == "C0" else "full"), 0.0
  if kind[:1] in ("R", "H"):
    try:
      value = float(kind[1:])
    except ValueError:
      value = None
    if value is not None and value > 0 and (value <= 1 if kind[0] == "R" else
                                            value.is_integer()):
      return kind[0], value
  raise ConfigError(f"validation.kinds: unknown subcorpus {kind!r}: expected C0, R<fraction> "
                    "(0 < fraction <= 1, e.g. R0.1), H<k> (e.g. H8) or full")


def select(kind: str, num_passages: int, c0: np.ndarray, retrieved=None,
           seed: int = 0) -> np.ndarray:
  """The passage rows of subcorpus `kind` of a corpus of `num_passages`."""
  name, value = parse_kind(kind)
  if name == "C":
    return c0
  if name == "full":
    return np.arange(num_passages)
  if name == "R":
    return random_subcorpus(num_passages, c0, value, seed)
  if retrieved is None:
    raise ValueError(f"{kind} needs the passages a model retrieves from the full index")
  return hard_subcorpus(c0, retrieved, int(value))


def evaluate_subcorpus(model, tokenizer, passages: Sequence[Passage],
                       questions: Sequence[dict], *, data: DataSettings, mesh,
                       batch_size: int, max_answer_length: int = 10) -> dict:
  """Encodes `passages` with the model's current parameters (in memory), indexes them exactly
  and answers `questions` ([{question, answers}]); returns EM@1/EM@10 and passage Top-k."""
  arrays = encode_shard(tokenizer, list(passages), training_windows_config(data, batch_size),
                        mesh, bound(model, "phrases_and_filter"))
  dump = Dump(directory=None, passages=list(passages),
              manifest={"fingerprint": encoder_fingerprint(model), "complete": True,
                        "num_passages": len(passages), "num_tokens": len(arrays["vectors"])},
              **arrays)
  index = PhraseIndex.over_passages(dump)
  q_start, q_end = encode_questions(model, tokenizer, [q.question for q in questions],
                                    max_query_length=data.max_query_length,
                                    batch_size=batch_size, mesh=mesh)
  report = retrieval_scores(index, q_start, q_end, [q.answers for q in questions],
                            max_answer_length=max_answer_length)
  report.update(passages=len(passages), tokens=int(len(arrays["vectors"])))
  return report


def read_subcorpus(path: str | os.PathLike) -> list[Passage]:
  summary = SkipSummary()
  passages = list(read_corpus(path, summary))
  if summary.total:
    log.warning("%s", summary)
  return passages


def subcorpus_questions(corpus: str | os.PathLike) -> str | None:
  """The questions a subcorpus was built for (its `.meta.json`, `run.py subcorpus`: the sample of
  `validation.sample_questions`, whose gold passages make its C_0), if it records them."""
  meta = pathlib.Path(corpus).with_suffix(".meta.json")
  return read_json(meta).get("questions") if meta.is_file() else None


class Validator:
  """Validation on a subcorpus during training (the `validation` section, Kim et al. 2022):
  every `every_steps` the subcorpus is encoded with the current parameters and indexed (exact,
  in memory), the dev questions are answered over it, and the checkpoint manager of
  `workdir/checkpoints_best` keeps the checkpoint with the best `metric` (e.g. em@1)."""

  def __init__(self, validation: ValidationSettings, data: DataSettings,
               evaluation: EvalSettings, workdir: pathlib.Path, dev_file, tokenizer, mesh,
               batch_size, writer):
    """Reads the subcorpus and its questions (`validation.questions`, else those it was built
    for, else `dev_file`'s), encoded with `data`'s windows and answered as `evaluation` says."""
    self.passages = self.check(validation)
    self.every_steps, self.metric = validation.every_steps, validation.metric
    questions = validation.questions or subcorpus_questions(validation.corpus) or dev_file
    self.questions = read_questions(questions)[:validation.limit or None]
    self.data, self.max_answer_length = data, evaluation.max_answer_length
    self.tokenizer, self.mesh = tokenizer, mesh
    self.batch_size, self.writer = batch_size, writer
    self.checkpointer = Checkpointer(Workdir(workdir).checkpoints("best"), keep=1,
                                     best_metric=self.metric)
    # The validations before a resume (metrics.jsonl holds them up to the restored step).
    self.history: dict[int, dict] = {
        r["step"]: r for _, r in (MetricsWriter.read(writer.path)
                                  if writer is not None and writer.path.is_file() else [])
        if r.get("split") == "validation"}
    log.info("validation every %d steps on %s (%d passages, %d questions of %s), best by %s",
             self.every_steps, validation.corpus, len(self.passages), len(self.questions),
             questions, self.metric)

  @staticmethod
  def check(validation: ValidationSettings) -> list[Passage]:
    """Config errors surface before any work, not after the first `every_steps` of training;
    returns the subcorpus's passages."""
    if validation.metric not in METRICS:
      raise ConfigError(f"validation.metric {validation.metric!r} is not one of "
                        f"{', '.join(METRICS)}")
    if not pathlib.Path(validation.corpus).is_file():
      raise ConfigError(f"validation.corpus {validation.corpus}: no such file")
    passages = read_subcorpus(validation.corpus)
    if not passages:
      raise ConfigError(f"validation.corpus {validation.corpus}: no passage in it")
    return passages

  def __call__(self, step: int, model, state, meta: dict) -> dict:
    report = evaluate_subcorpus(model, self.tokenizer, self.passages, self.questions,
                                data=self.data, mesh=self.mesh,
                                batch_size=self.batch_size,
                                max_answer_length=self.max_answer_length)
    self.history[step] = report
    self.writer.write({"step": step, "split": "validation", **report})
    log.info("step %d: validation EM@1 %.2f EM@10 %.2f on %d passages", step, report["em@1"],
             report["em@10"], report["passages"])
    self.checkpointer.save(step, state, meta, metrics={self.metric: report[self.metric]})
    return report

  def best(self) -> dict:
    step = self.checkpointer.best_step()
    if step is None:
      return {}
    return {"best_step": step, f"best_validation_{self.metric}":
            self.history.get(step, {}).get(self.metric)}

  def close(self) -> None:
    self.checkpointer.close()
