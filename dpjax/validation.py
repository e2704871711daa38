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
import json
import logging
import os
import pathlib
from typing import Sequence

import numpy as np

from dpjax import metrics
from dpjax.config import ConfigError
from dpjax.corpus import CorpusPassage, read_corpus
from dpjax.data.squad import DataError, SkipSummary, read_squad

log = logging.getLogger(__name__)


def gold_rows(corpus: Sequence[CorpusPassage], questions_file: str | os.PathLike) -> np.ndarray:
  """Rows of `corpus` that are the gold passage (same title and text) of a dev question."""
  passages, questions, _ = read_squad(questions_file)
  wanted = {(passages[q.passage_index].title, passages[q.passage_index].context)
            for q in questions}
  rows = np.array([i for i, p in enumerate(corpus) if (p.title, p.text) in wanted], np.int64)
  missing = len(wanted) - len(rows)
  if missing:
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


def write_subcorpus(path: str | os.PathLike, corpus: Sequence[CorpusPassage], rows: np.ndarray,
                    provenance: dict) -> dict:
  """Writes `corpus[rows]` as JSONL and `<path stem>.meta.json`; returns the metadata."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w", encoding="utf-8") as f:
    for row in rows.tolist():
      f.write(json.dumps(dataclasses.asdict(corpus[row]), ensure_ascii=False) + "\n")
  os.replace(tmp, path)
  meta = {"passages": int(len(rows)), "corpus_passages": len(corpus), **provenance}
  meta_path = path.with_suffix(".meta.json")
  meta_tmp = meta_path.with_name(meta_path.name + ".tmp")
  meta_tmp.write_text(json.dumps(meta, indent=1))
  os.replace(meta_tmp, meta_path)
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
    if value is not None and value > 0 and (kind[0] == "R" or value.is_integer()):
      return kind[0], value
  raise ConfigError(f"validation.kinds: unknown subcorpus {kind!r}: expected C0, R<fraction> "
                    "(e.g. R0.1), H<k> (e.g. H8) or full")


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


# What `open_domain_eval` reports (validation.metric must be one of these).
METRICS = ("em@1", "f1@1", "em@10", "f1@10", "top1", "top5", "top20", "mrr@20", "p@20")


def open_domain_eval(index, q_start: np.ndarray, q_end: np.ndarray, answers, *,
                     max_answer_length: int = 10, passages: bool = True,
                     per_question: bool = False) -> dict:
  """EM@1/EM@10 (phrases) and, optionally, passage Top-k/MRR@20/P@20 over a PhraseIndex.

  `per_question=True` adds `hits`: per question, whether its top phrase is an answer ("em@1")
  and whether a top-20 passage contains one ("top20"), as strings of 0/1 (paired tests)."""
  found = index.search(q_start, q_end, 10, "phrase", max_answer_length=max_answer_length)
  texts = [[p.text for p, _ in units] for units in found]
  report = metrics.open_domain_scores(texts, answers)
  if per_question:
    report["hits"] = {"em@1": "".join(
        str(int(bool(t) and metrics.max_over_gold(metrics.exact_match, t[0], golds) > 0))
        for t, golds in zip(texts, answers))}
  if passages:
    ranked = index.search(q_start, q_end, 20, "passage", max_answer_length=max_answer_length)
    ranked_texts = [[index.dump.passages[p.passage].text for p, _ in units] for units in ranked]
    report.update(metrics.passage_scores(ranked_texts, answers, ks=(1, 5, 20)))
    if per_question:
      report["hits"]["top20"] = "".join(
          str(int(any(metrics.has_answer(d, golds) for d in docs[:20])))
          for docs, golds in zip(ranked_texts, answers))
  return report


def evaluate_subcorpus(model, tokenizer, passages: Sequence[CorpusPassage],
                       questions: Sequence[dict], *, data_config, mesh, batch_size: int,
                       max_answer_length: int = 10) -> dict:
  """Encodes `passages` with the model's current parameters (in memory), indexes them exactly
  and answers `questions` ([{question, answers}]); returns EM@1/EM@10 and passage Top-k."""
  from flax import nnx

  from dpjax.index.dump import Dump, DumpConfig, encode_shard, encoder_fingerprint
  from dpjax.rc import make_encoders
  from dpjax.search import PhraseIndex, encode_questions

  config = DumpConfig(max_seq_length=data_config.max_seq_length,
                      doc_stride=data_config.doc_stride,
                      include_title=data_config.include_title, batch_size=batch_size)
  graphdef, state = nnx.split(model)
  encoders = make_encoders(graphdef)
  arrays = encode_shard(tokenizer, list(passages), config, mesh,
                        lambda i, m: encoders.phrases_and_filter(state, i, m))
  dump = Dump(directory=None, passages=list(passages),
              manifest={"fingerprint": encoder_fingerprint(model), "complete": True,
                        "num_passages": len(passages), "num_tokens": len(arrays["vectors"])},
              **arrays)
  index = PhraseIndex.over_passages(dump)
  q_start, q_end = encode_questions(model, tokenizer, [q["question"] for q in questions],
                                    max_query_length=data_config.max_query_length,
                                    batch_size=batch_size, mesh=mesh)
  report = open_domain_eval(index, q_start, q_end, [q["answers"] for q in questions],
                            max_answer_length=max_answer_length)
  report.update(passages=len(passages), tokens=int(len(arrays["vectors"])))
  return report


def read_subcorpus(path: str | os.PathLike) -> list[CorpusPassage]:
  summary = SkipSummary()
  passages = list(read_corpus(path, summary))
  if summary.total:
    log.warning("%s", summary)
  return passages
