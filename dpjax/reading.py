"""Reading comprehension: answer spans read from passage windows, by the phrase model or by the
cross-encoder reader, and the retriever-reader pipeline of `run.py eval` (`eval.reader`).

A question's answer in a passage window is the span (i, j), i <= j < i + max_answer_length, of
context tokens with the highest q_start . h_i + q_end . h_j; the start token must be in its
"max context" window, so a token shared by overlapping windows is scored once. The best span over
all windows of the question's passage is the prediction; EM/F1 use the official scorer. The
cross-encoder teacher (`models.reader`) is scored the same way from its start/end logits.

`read_retrieved` is the retriever-reader pipeline's second half: the reader reads each
question's top-k retrieved passages (BM25's, or dpjax's passage search) and answers with the best
span over all their windows; `mixed_answers` weighs each passage's best span with the retriever's
score of the passage instead (BERTserini).

The cross-encoder reader of `run.py teacher` (in the workdir `eval.reader`, with the model and
windows that workdir saved) reads each question's top `eval.reader_passages` passages of the
phrase index's passage ranking, and answers as BERTserini (Yang et al. 2019) does
(`mixed_answers`): the best span of the passage with the highest (1 - mu) x the retriever's
score of it + mu x the reader's score of its best span. The reader's scores alone are not
comparable across passages (it was trained on windows that hold the answer), hence the mix. mu is
`eval.reader_mu`, or, unset, chosen from `MU_GRID` by EM@1 on `eval.reader_tune_questions` random
training questions (seeded; never the evaluation's), every mu's EM@1 recorded.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import pathlib
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from dpjax import metrics
from dpjax.checkpoint import restore_params
from dpjax.data import Tokenizer, data_files
from dpjax.data.batches import cross_batch
from dpjax.data.questions import read_questions, sample_questions
from dpjax.data.squad import Passage, Question, RCFeatures
from dpjax.data.windows import PassageWindows, build_windows
from dpjax.errors import ConfigError, DataError
from dpjax.workdir import Workdir
from dpjax.models.encoders import (bound, bound_questions, phrase_batches, phrase_compiles,
                                   question_compiles, question_vectors)
from dpjax.models.reader import CrossEncoderReader, check_input_length, create_reader, logits_fn
from dpjax.parallel import make_mesh, map_batches, round_to_devices
from dpjax.settings import DataSettings, EvalSettings, ModelSettings

log = logging.getLogger(__name__)


def best_spans(start_scores: np.ndarray, end_scores: np.ndarray, start_ok: np.ndarray,
               end_ok: np.ndarray, max_answer_length: int):
  """Highest-scoring span per row.

  Args:
    start_scores, end_scores: [F, L] token scores.
    start_ok, end_ok: [F, L] bool, the tokens allowed as start / end.
    max_answer_length: spans cover at most this many tokens.

  Returns:
    (start [F], end [F], score [F]); score is -inf for rows with no allowed span.
  """
  neg = np.float32(-np.inf)
  s = np.where(start_ok, start_scores, neg)
  e = np.where(end_ok, end_scores, neg)
  rows, length = s.shape
  best = np.full(rows, neg, np.float32)
  best_start = np.zeros(rows, np.int64)
  best_len = np.zeros(rows, np.int64)
  for width in range(min(max_answer_length, length)):
    cand = s[:, :length - width] + e[:, width:]  # span (i, i + width)
    i = np.argmax(cand, axis=1)
    score = cand[np.arange(rows), i]
    better = score > best
    best = np.where(better, score, best)
    best_start = np.where(better, i, best_start)
    best_len = np.where(better, width, best_len)
  return best_start, best_start + best_len, best


def predict_rc(model, features: RCFeatures, passages: list[Passage], *, mesh,
               batch_size: int = 32, max_answer_length: int = 10) -> dict[int, str]:
  """Predicts an answer for every question of `features`; returns {question index: text}."""
  q_start, q_end = question_vectors(bound_questions(model), features.question_input_ids,
                                    features.question_attention_mask, batch_size=batch_size,
                                    mesh=mesh)
  windows = features.windows
  in_batch = np.full(len(windows.input_ids), -1)  # window -> its row in the current batch
  best: dict[int, tuple[float, str]] = {}
  for rows, vectors in phrase_batches(bound(model, "phrases"), windows.input_ids,
                                     windows.attention_mask, batch_size=batch_size, mesh=mesh):
    in_batch[rows] = np.arange(len(rows))
    feats = np.nonzero(in_batch[features.window_index] >= 0)[0]
    w = features.window_index[feats]
    h = vectors[in_batch[w]]  # [F, L', D], L' <= L: the batch's width (the rest is padding)
    in_batch[rows] = -1
    if not len(feats):
      continue
    q = features.question_index[feats]
    keep_best(best, features, passages, feats, np.einsum("fld,fd->fl", h, q_start[q]),
              np.einsum("fld,fd->fl", h, q_end[q]), max_answer_length)
  return {qi: text for qi, (_, text) in best.items()}


def rc_compiles(model, features: RCFeatures, *, mesh,
                batch_size: int = 32) -> list[Callable[[], None]]:
  """A function per encoder call shape `predict_rc` makes on `features` that compiles it
  (`shape_compiles`): run ahead, at once with other compiles (`compile_at_once`), its calls
  then compile nothing. The model's parameters may change meanwhile, not their shapes. A
  `CrossEncoderReader` (the teacher) has none: its calls compile as they come."""
  if isinstance(model, CrossEncoderReader):
    return []
  windows = features.windows
  return (question_compiles(bound_questions(model), features.question_input_ids,
                            features.question_attention_mask, batch_size=batch_size, mesh=mesh)
          + phrase_compiles(bound(model, "phrases"), windows.attention_mask,
                            batch_size=batch_size, mesh=mesh))


def window_spans(windows: PassageWindows, w: np.ndarray, start_scores: np.ndarray,
                 end_scores: np.ndarray, max_answer_length: int):
  """The best span of each of windows `w` [F] given its token scores [F, L'] (L' <= L: the
  columns past L' are padding): it starts at a context token of its max-context window (a token
  shared by overlapping windows is a start in one of them only) and ends at a context token of
  the same window. Returns `best_spans`' (start [F], end [F], score [F]), window positions."""
  width = start_scores.shape[1]
  return best_spans(start_scores, end_scores,
                    (windows.context_mask[w] & windows.is_max_context[w])[:, :width],
                    windows.context_mask[w, :width], max_answer_length)


def keep_best(best: dict, features: RCFeatures, passages: list[Passage], feats: np.ndarray,
              start_scores: np.ndarray, end_scores: np.ndarray, max_answer_length: int) -> None:
  """Updates `best` ({question index: (score, answer text)}) with the best span of each feature
  row `feats` given its token scores [F, L'] (L' <= L: the columns past L' are padding)."""
  windows, w = features.windows, features.window_index[feats]
  start, end, score = window_spans(windows, w, start_scores, end_scores, max_answer_length)
  for f, qi in enumerate(features.question_index[feats].tolist()):
    if np.isfinite(score[f]) and score[f] > best.get(qi, (-np.inf, ""))[0]:
      context = passages[windows.passage_index[w[f]]].text
      text = context[windows.char_start[w[f], start[f]]:windows.char_end[w[f], end[f]]]
      best[qi] = (float(score[f]), text)


def reader_logits(reader, features: RCFeatures, rows: np.ndarray, *, mesh,
                  batch_size: int = 32) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """(feature rows, the cross-encoder reader's start/end logits [n, L, 2] at their window
  positions), batch by batch, for feature `rows`: longest inputs first, each batch cut to its
  longest `[CLS] question [SEP] window` rounded up to 32 tokens (most SQuAD windows are
  shorter than the window plus question length they are padded to); the logits are then read
  at the window positions on the host."""
  rows = np.asarray(rows)
  inputs = cross_batch(features, rows)
  keys = ("cross_input_ids", "cross_attention_mask", "cross_token_type_ids")
  for at, logits in map_batches(logits_fn(reader), [inputs[k] for k in keys], batch_size, mesh,
                                lengths=inputs["cross_attention_mask"].sum(1)):
    # A window position past the cut is padding of the window (the context mask excludes it).
    align = np.minimum(inputs["cross_align"][at], logits.shape[1] - 1)
    yield rows[at], np.take_along_axis(logits, align[..., None], axis=1)


def predict_rc_reader(reader, features: RCFeatures, passages: list[Passage], *, mesh,
                      batch_size: int = 32, max_answer_length: int = 10) -> dict[int, str]:
  """The cross-encoder reader's answer to every question of `features` (as `predict_rc`)."""
  best: dict[int, tuple[float, str]] = {}
  for rows, logits in reader_logits(reader, features, np.arange(len(features)), mesh=mesh,
                                    batch_size=batch_size):
    keep_best(best, features, passages, rows, logits[..., 0], logits[..., 1], max_answer_length)
  return {qi: text for qi, (_, text) in best.items()}


@dataclasses.dataclass(frozen=True)
class ReadAnswer:
  """The reader's answer to a question from its retrieved passages (`read_retrieved`)."""
  text: str
  score: float  # the reader's start logit + end logit of the span
  passage_row: int  # the passage it is read from: a row of `passages`
  rank: int  # that passage's place in the question's retrieved list (0: the retriever's first)
  char_start: int  # passages[passage_row].text[char_start:char_end] == text
  char_end: int
  token_start: int  # the span's first and last context tokens in the passage (not the window)
  token_end: int


def retrieved_features(tokenizer: Tokenizer, data_config, questions: Sequence[str],
                       passages: Sequence[Passage], retrieved: Sequence[Sequence[int]],
                       ) -> tuple[RCFeatures, np.ndarray, np.ndarray]:
  """One feature per (question, window of one of its retrieved passages), windowed as RC's
  (`data.max_seq_length`, `doc_stride`, `include_title`; questions cut at `max_query_length`).

  Each distinct passage is windowed once; rows below 0 (a retriever's padding) and a row
  repeated in a question's list (after its first place) are skipped. Returns (features, the
  row in `passages` of each window's passage [W], the rank of each feature's passage [N])."""
  rows = np.unique(np.asarray([r for ranked in retrieved for r in ranked if r >= 0], np.int64))
  windows, _ = build_windows(tokenizer, [passages[r] for r in rows.tolist()],
                             max_seq_length=data_config.max_seq_length,
                             doc_stride=data_config.doc_stride,
                             include_title=data_config.include_title)
  q_ids, q_mask = tokenizer.encode(list(questions), data_config.max_query_length)
  windows_of = collections.defaultdict(list)  # local passage index -> its windows
  for w, local in enumerate(windows.passage_index.tolist()):
    windows_of[local].append(w)
  local_of = {row: i for i, row in enumerate(rows.tolist())}
  pairs = []  # (question, window, rank of the window's passage)
  for qi, ranked in enumerate(retrieved):
    ranked = list(ranked)
    for place, row in enumerate(ranked):
      if row >= 0 and row not in ranked[:place]:
        pairs += [(qi, w, place) for w in windows_of[local_of[row]]]
  question, window, rank = np.asarray(pairs, np.int32).reshape(-1, 3).T
  zeros = np.zeros(len(pairs), np.int32)  # no gold positions: the answer is unknown
  features = RCFeatures(windows, q_ids, q_mask, question, window, zeros, zeros)
  return features, rows[windows.passage_index], rank


def read_retrieved(reader: CrossEncoderReader, tokenizer: Tokenizer, data_config,
                   questions: Sequence[str], passages: Sequence[Passage],
                   retrieved: Sequence[Sequence[int]], *, mesh, batch_size: int = 32,
                   max_answer_length: int = 10, questions_per_call: int = 256,
                   ) -> list[ReadAnswer | None]:
  """The retriever-reader pipeline's answers: the cross-encoder reader reads every window of
  each question's retrieved passages (`retrieved[q]`: rows of `passages`, best first) and
  answers with the best span over all of them, as RC does over one passage's windows
  (`window_spans`: start logit + end logit, at most `max_answer_length` tokens, within one
  window). The score is the reader's alone, the retriever's rank or score not added (as
  DrQA's and DPR's readers over their top-k passages, without a passage selector; `mixed_answers`
  adds it); `rank` says which retrieved passage won. None for a question with no passage.

  `questions_per_call` questions are windowed and read at a time (host memory bounded)."""
  return reader_answers(read_retrieved_passages(
      reader, tokenizer, data_config, questions, passages, retrieved, mesh=mesh,
      batch_size=batch_size, max_answer_length=max_answer_length,
      questions_per_call=questions_per_call))


def reader_answers(per_passage: Sequence[Sequence[ReadAnswer | None]]) -> list[ReadAnswer | None]:
  """`read_retrieved`'s answers from its reading kept by passage (`read_retrieved_passages`):
  the best span by the reader's score alone, at an equal score the better-ranked passage's."""
  return mixed_answers(per_passage, [[0.0] * len(spans) for spans in per_passage], mu=1.0)


def read_retrieved_passages(reader: CrossEncoderReader, tokenizer: Tokenizer, data_config,
                            questions: Sequence[str], passages: Sequence[Passage],
                            retrieved: Sequence[Sequence[int]], *, mesh, batch_size: int = 32,
                            max_answer_length: int = 10, questions_per_call: int = 256,
                            ) -> list[list[ReadAnswer | None]]:
  """The reader's best span in each retrieved passage (`read_retrieved`'s reading, kept apart by
  passage): per question, a list indexed by rank (`len(retrieved[q])`), None at a rank with no
  span (a retriever's padding, a passage repeated after its first place)."""
  check_input_length(reader, data_config)
  answers: list[list[ReadAnswer | None]] = []
  for lo in range(0, len(questions), questions_per_call):
    part = slice(lo, lo + questions_per_call)
    features, passage_rows, rank = retrieved_features(tokenizer, data_config, questions[part],
                                                      passages, retrieved[part])
    best: dict[tuple[int, int], ReadAnswer] = {}  # (question, rank) -> its best span
    read = (reader_logits(reader, features, np.arange(len(features)), mesh=mesh,
                          batch_size=batch_size) if len(features) else [])
    for feats, logits in read:
      w = features.window_index[feats]
      start, end, score = window_spans(features.windows, w, logits[..., 0], logits[..., 1],
                                       max_answer_length)
      for f, qi in enumerate(features.question_index[feats].tolist()):
        key = (qi, int(rank[feats[f]]))
        # Windows of one passage come in any order: at an equal score the first read stays.
        if np.isfinite(score[f]) and (key not in best or score[f] > best[key].score):
          best[key] = _read_answer(features.windows, passages, int(w[f]), int(start[f]),
                                   int(end[f]), float(score[f]), int(passage_rows[w[f]]), key[1])
    answers += [[best.get((qi, r)) for r in range(len(ranked))]
                for qi, ranked in enumerate(retrieved[part])]
  return answers


def mixed_answers(per_passage: Sequence[Sequence[ReadAnswer | None]],
                  retriever_scores: Sequence[Sequence[float]], mu: float,
                  ) -> list[ReadAnswer | None]:
  """BERTserini's answer (Yang et al. 2019): per question, the best span of the passage with the
  highest (1 - mu) * retriever score + mu * reader score (start + end logit); at an equal
  mixed score, the better-ranked passage's. mu = 1 is the reader alone (`read_retrieved`).

  Args:
    per_passage: [Q][k_q] the best span of each retrieved passage, by rank
      (`read_retrieved_passages`), None where there is none.
    retriever_scores: [Q][k_q] the retriever's score of each, finite where a span is.
    mu: the reader's weight, in [0, 1].

  Returns:
    [Q] the chosen span, None for a question without any.
  """
  if not 0.0 <= mu <= 1.0:
    raise ValueError(f"mu {mu}: the reader's weight is in [0, 1]")
  width = max([1] + [len(spans) for spans in per_passage])  # argmax needs a column
  reader = np.full((len(per_passage), width), -np.inf)
  retriever = np.zeros((len(per_passage), width))
  for q, (spans, scores) in enumerate(zip(per_passage, retriever_scores, strict=True)):
    if len(spans) != len(scores):
      raise ValueError(f"question {q}: {len(spans)} passages read, {len(scores)} scores")
    reader[q, :len(spans)] = [-np.inf if a is None else a.score for a in spans]
    retriever[q, :len(spans)] = scores
  read = np.isfinite(reader)
  if not np.isfinite(retriever[read]).all():
    raise ValueError("a passage with a span has a retriever score that is not finite")
  mixed = np.where(read, (1.0 - mu) * retriever + mu * np.where(read, reader, 0.0), -np.inf)
  best = np.argmax(mixed, axis=1)  # the first of equal maxima: the better rank
  return [per_passage[q][best[q]] if read[q].any() else None for q in range(len(per_passage))]


def _read_answer(windows: PassageWindows, passages: Sequence[Passage], w: int, start: int,
                 end: int, score: float, row: int, rank: int) -> ReadAnswer:
  """The span [start, end] (positions) of window `w` of passage `passages[row]`."""
  char_start, char_end = int(windows.char_start[w, start]), int(windows.char_end[w, end])
  first_context = int(np.argmax(windows.context_mask[w]))
  offset = int(windows.token_offset[w]) - first_context
  return ReadAnswer(passages[row].text[char_start:char_end], score, row, rank, char_start,
                    char_end, start + offset, end + offset)


def restore_reader(model: ModelSettings,
                   workdir: str | pathlib.Path) -> tuple[CrossEncoderReader, int]:
  """(reader, step): `model`'s cross-encoder with the parameters of the latest checkpoint of
  `run.py teacher` in `workdir` (`teacher/checkpoints`)."""
  checkpoints = Workdir(workdir).teacher.checkpoints()
  reader = create_reader(model)
  step = restore_params(checkpoints, reader) if checkpoints.is_dir() else None
  if step is None:
    raise DataError(f"{checkpoints}: no reader checkpoint (train one with `run.py teacher`)")
  return reader, step


def evaluate_rc(model, features: RCFeatures, passages: list[Passage], questions: list[Question],
                *, mesh, batch_size: int = 32, max_answer_length: int = 10):
  """Official-equivalent EM/F1 (x100) over all questions, and the {question id: answer} map, of
  the phrase model or (a `CrossEncoderReader`) the teacher."""
  predict = predict_rc_reader if isinstance(model, CrossEncoderReader) else predict_rc
  answers = predict(model, features, passages, mesh=mesh, batch_size=batch_size,
                    max_answer_length=max_answer_length)
  predictions = {questions[qi].id: text for qi, text in answers.items()}
  gold = {q.id: q.answers for q in questions}
  return metrics.squad_em_f1(predictions, gold), predictions


# Only the ratio mu / (1 - mu) of the reader's weight to the retriever's moves the argmax, and
# the two scores have scales of their own, so the ratio doubles from 1/64 to 64 (an even grid in
# mu would hold only 1/9 to 9); the retriever alone (0) and the reader alone (1) are in it.
MU_GRID = (0.0, *(round(2.0 ** j / (1 + 2.0 ** j), 4) for j in range(-6, 7)), 1.0)
TUNE_SEED = 17  # the training questions mu is chosen on (as hybrid_weights' for hybrid search)


def em_hits(predictions, answers) -> str:
  """Per question, whether its one answer (None: none) matches a gold one, as a 0/1 string."""
  return "".join(str(int(p is not None and metrics.max_over_gold(metrics.exact_match, p, g) > 0))
                 for p, g in zip(predictions, answers))


def em_at_1(found, answers) -> float:
  """EM@1 (x100) of `reading.ReadAnswer`s (None: no answer)."""
  hits = em_hits([a.text if a else None for a in found], answers)
  return 100.0 * hits.count("1") / max(len(answers), 1)


def median_spread(per_passage, retriever_scores) -> dict:
  """The median over questions of the range (max - min) of the retriever's and of the reader's
  scores over the passages read: the two scales mu weighs against each other."""
  spreads = {"retriever": [], "reader": []}
  for spans, scores in zip(per_passage, retriever_scores):
    read = [(r, a.score) for a, r in zip(spans, scores) if a is not None]
    if len(read) > 1:
      for name, values in zip(spreads, zip(*read)):
        spreads[name].append(max(values) - min(values))
  return {name: float(np.median(v)) if v else None for name, v in spreads.items()}


def choose_mu(per_passage, retriever_scores, answers) -> dict:
  """The mu of `MU_GRID` with the best EM@1 of `reading.mixed_answers` on held-out questions (ties
  to the smaller mu), with every mu's EM@1 and the scores' spreads."""
  scores = {mu: em_at_1(mixed_answers(per_passage, retriever_scores, mu), answers)
            for mu in MU_GRID}
  best = max(MU_GRID, key=lambda mu: (scores[mu], -mu))
  return {"mu": best, "em@1": {str(mu): em for mu, em in scores.items()},
          "median_spread": median_spread(per_passage, retriever_scores)}


class Reader:
  """`eval.reader`'s reader, ready to read the passages a phrase index ranked."""

  def __init__(self, model: ModelSettings, data: DataSettings, evaluation: EvalSettings):
    """Restores the reader of the workdir `evaluation.reader`; `model` and `data` are the
    reader's own (those that workdir saved, `run.py eval` reads them), its model and windows."""
    workdir = pathlib.Path(evaluation.reader)
    self.data = data  # the reader's windows
    self.model, self.step = restore_reader(model, workdir)
    self.tokenizer = Tokenizer.from_pretrained(model.tokenizer)
    self.mesh = make_mesh()
    self.batch_size = round_to_devices(evaluation.batch_size, self.mesh)
    self.max_answer_length = evaluation.max_answer_length

  def read(self, texts, passages, rows):
    """The reader's best span in each passage of `rows` [Q][k] (`read_retrieved_passages`)."""
    return read_retrieved_passages(self.model, self.tokenizer, self.data, texts, passages,
                                   rows, mesh=self.mesh, batch_size=self.batch_size,
                                   max_answer_length=self.max_answer_length)


def check_reader_config(data: DataSettings, evaluation: EvalSettings, workdir) -> None:
  """Refuses `eval.reader` settings no run can use, before any work."""
  mu = evaluation.reader_mu
  if mu is not None and not 0.0 <= mu <= 1.0:
    raise ConfigError(f"eval.reader_mu {mu}: the reader's weight is in [0, 1]")
  if evaluation.passage_k < evaluation.reader_passages:
    raise ConfigError(f"eval.reader_passages {evaluation.reader_passages} is more than "
                      f"eval.passage_k {evaluation.passage_k}, the passages ranked")
  if evaluation.regex:
    raise ConfigError("eval.reader with eval.regex: the reader's answers are scored as text "
                      "(SQuAD EM), not against regular expressions")
  if not pathlib.Path(evaluation.reader).is_dir():
    raise ConfigError(f"eval.reader {evaluation.reader}: no such workdir (one holding a "
                      "`run.py teacher` reader)")
  checkpoints = Workdir(evaluation.reader).teacher.checkpoints()
  if not checkpoints.is_dir():
    raise ConfigError(f"eval.reader {evaluation.reader}: no reader checkpoint in {checkpoints} "
                      "(train one with `run.py teacher`)")
  train = data_files(data, workdir).get("train")
  if mu is None and not (train and pathlib.Path(train).is_file()):
    raise ConfigError(f"eval.reader_mu is unset and there are no training questions ({train}) "
                      "to choose it on: set eval.reader_mu")


def ranked_passages(found_passages, k: int) -> tuple[list[list[int]], list[list[float]]]:
  """(the top-k passage rows [Q][k], their scores) of the index's passage ranking."""
  top = [units[:k] for units in found_passages]
  return ([[unit.passage for unit, _ in units] for units in top],
          [[unit.score for unit, _ in units] for units in top])


def tuned_mu(data: DataSettings, evaluation: EvalSettings, workdir, reader: Reader, searcher,
             evaluated: set[str]) -> dict:
  """mu chosen on `eval.reader_tune_questions` random training questions (none of the
  `evaluated` ids), searched by `searcher` as the evaluation's are (`choose_mu`), with a record
  of the questions."""
  path = data_files(data, workdir)["train"]
  questions = sample_questions([q for q in read_questions(path) if q.id not in evaluated],
                               evaluation.reader_tune_questions, TUNE_SEED)
  texts = [q.question for q in questions]
  # ranked as the evaluation ranks: its passage_k, then the first reader_passages
  found = searcher.search(texts, k=evaluation.passage_k, unit="passage",
                          max_answer_length=evaluation.max_answer_length)
  top = [results[:evaluation.reader_passages] for results in found]
  rows = [[r["passage_row"] for r in results] for results in top]
  scores = [[r["score"] for r in results] for results in top]
  choice = choose_mu(reader.read(texts, searcher.index.dump.passages, rows), scores,
                     [q.answers for q in questions])
  log.info("reader mu %g chosen on %d questions of %s", choice["mu"], len(questions), path)
  return {**choice, "questions": len(questions), "file": str(path), "seed": TUNE_SEED,
          "criterion": "EM@1, ties to the smaller mu"}


def read_answers(reader: Reader, data: DataSettings, evaluation: EvalSettings, workdir, searcher,
                 questions, found_passages,
                 search_seconds: float) -> tuple[dict, list[str | None]]:
  """(the report's "reader" record, each question's answer) of `reader`'s pipeline over the
  passages the evaluation's search ranked (`found_passages`: its passage units per question);
  mu is chosen on training questions of `data` unless `eval.reader_mu` sets it."""
  k = evaluation.reader_passages
  if evaluation.reader_mu is None:
    tuning = tuned_mu(data, evaluation, workdir, reader, searcher, {q.id for q in questions})
    mu = tuning["mu"]
  else:
    tuning, mu = {"set": "eval.reader_mu"}, evaluation.reader_mu
  texts, answers = [q.question for q in questions], [q.answers for q in questions]
  rows, scores = ranked_passages(found_passages, k)
  start = time.perf_counter()
  found = mixed_answers(reader.read(texts, searcher.index.dump.passages, rows), scores, mu)
  seconds = time.perf_counter() - start
  predictions = [a.text if a else None for a in found]
  hits = em_hits(predictions, answers)
  record = {"workdir": str(evaluation.reader), "step": reader.step, "passages": k, "mu": mu,
            "mu_tuning": tuning,
            **metrics.open_domain_scores([[p] if p is not None else [] for p in predictions],
                                         answers, ks=(1,)),
            "hits": {"em@1": hits}, "reading_seconds": seconds,
            "questions_per_sec": len(questions) / (search_seconds + seconds)}
  log.info("reader over the top %d passages (mu %g): EM@1 %.2f; %.1f questions/s with the "
           "search", k, mu, record["em@1"], record["questions_per_sec"])
  return record, predictions
