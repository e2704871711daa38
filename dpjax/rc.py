"""Reading-comprehension prediction and evaluation for the phrase model.

A question's answer in a passage window is the span (i, j), i <= j < i + max_answer_length, of
context tokens with the highest q_start . h_i + q_end . h_j; the start token must be in its
"max context" window, so a token shared by overlapping windows is scored once. The best span over
all windows of the question's passage is the prediction; EM/F1 use the official scorer. The
cross-encoder teacher (`models.reader`) is scored the same way from its start/end logits.
"""
from __future__ import annotations

import logging
from typing import Iterator

import numpy as np

from dpjax import metrics
from dpjax.data import Tokenizer, data_files, load_rc_split
from dpjax.data.batches import cross_batch
from dpjax.data.squad import Passage, Question, RCFeatures
from dpjax.io import write_json
from dpjax.layout import Workdir
from dpjax.models.encoders import bound, bound_questions, phrase_batches, question_vectors
from dpjax.models.reader import CrossEncoderReader, logits_fn
from dpjax.parallel import make_mesh, map_batches, round_to_devices
from dpjax.workdir import restore_model

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


def keep_best(best: dict, features: RCFeatures, passages: list[Passage], feats: np.ndarray,
              start_scores: np.ndarray, end_scores: np.ndarray, max_answer_length: int) -> None:
  """Updates `best` ({question index: (score, answer text)}) with the best span of each feature
  row `feats` given its token scores [F, L'] (L' <= L: the columns past L' are padding)."""
  windows, w = features.windows, features.window_index[feats]
  width = start_scores.shape[1]
  start, end, score = best_spans(start_scores, end_scores,
                                 (windows.context_mask[w] & windows.is_max_context[w])[:, :width],
                                 windows.context_mask[w, :width], max_answer_length)
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


def run_eval_rc(config, workdir: str) -> dict:
  """`run.py eval_rc`: reading-comprehension EM/F1 on the dev split of the workdir's model (its
  latest checkpoint, or the best one with `eval.checkpoint=best`; the untrained configured model
  when the workdir has no checkpoint).

  Writes `workdir/rc_eval.json` (metrics) and `workdir/rc_predictions.json` ({id: answer}).
  """
  workdir = Workdir(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  dev = load_rc_split(data_files(config.data, workdir)["dev"], tokenizer, config.data,
                      limit=config.eval.limit or None)
  # The untrained model's RC accuracy is a baseline: a workdir without checkpoints is allowed.
  model, step = restore_model(config, workdir, allow_untrained=True)
  mesh = make_mesh()
  batch_size = round_to_devices(config.eval.batch_size, mesh)
  scores, predictions = evaluate_rc(model, dev.features, dev.passages, dev.questions,
                                    mesh=mesh, batch_size=batch_size,
                                    max_answer_length=config.eval.max_answer_length)
  log.info("RC dev (%s): EM %.2f F1 %.2f over %d questions", dev.path, scores["exact_match"],
           scores["f1"], scores["count"])
  write_json(workdir.report("rc_eval.json"), {**scores, "step": step})
  write_json(workdir.report("rc_predictions.json"), predictions)
  return scores
