"""Training objectives of the phrase and question encoders, on one (global) batch.

Recipes (`train.loss.recipe`):
  unified   Kim et al. 2022, Eq. 2: one softmax per question over its gold token and all
            negatives, each type weighted by lambda: in-passage, in-batch (every token of the
            other passages in the batch), pre-batch (every token of the C previous batches) and
            mined hard-negative passages.
  original  DensePhrases: L = w_single L_single + w_neg L_neg (+ w_distill L_distill with teacher
            logits), L_neg over the gold tokens of the batch and of the pre-batch queue.
  qsft      query-side fine-tuning: marginal likelihood of the retrieved phrases that match a gold
            answer (Eq. 11), plus the same on start-only and end-only scores (as the reference).
Both phrase recipes add lambda_distill (unified) / weight_distill (original) x KL(teacher ||
student) when the batch carries a cross-encoder teacher's logits (`train.teacher_logits`);
`teacher_loss` trains that teacher.
The pre-batch queue (token vectors and gold positions of the C previous batches, no gradient) is
the state an objective carries from step to step; it is part of the train state.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dpjax import losses
from dpjax.trainer import Objective


# ---------------------------------------------------------------------------------------------
# Pre-batch queue


def init_queue(size: int, batch_size: int, length: int, dim: int) -> dict:
  """An empty queue of `size` previous batches: all their token vectors and gold positions."""
  return {"vectors": jnp.zeros((size, batch_size, length, dim), jnp.float32),
          "mask": jnp.zeros((size, batch_size, length), bool),
          "passage_ids": jnp.full((size, batch_size), -1, jnp.int32),
          "start": jnp.zeros((size, batch_size), jnp.int32),
          "end": jnp.zeros((size, batch_size), jnp.int32),
          "valid": jnp.zeros((size,), bool)}


def push_queue(queue: dict, entry: dict) -> dict:
  """Drops the oldest batch and puts `entry` (one batch, no gradient) first."""
  if not queue:  # no pre-batch negatives
    return queue
  entry = {**jax.lax.stop_gradient(entry), "valid": jnp.ones((), bool)}
  return {k: jnp.concatenate([entry[k][None].astype(v.dtype), v[:-1]]) for k, v in queue.items()}


def queue_sharding(mesh, queue: dict) -> dict:
  if not queue:
    return {}
  batch_axis = NamedSharding(mesh, P(None, "data"))
  return {"vectors": batch_axis, "mask": batch_axis, "passage_ids": batch_axis,
          "start": batch_axis, "end": batch_axis, "valid": NamedSharding(mesh, P())}


def make_objective(loss_config, *, batch_size: int, length: int, dim: int) -> Objective:
  """The configured recipe with its pre-batch queue (`loss.prebatch_size` batches; QSFT: none)."""
  size = loss_config.prebatch_size if loss_config.recipe != "qsft" else 0
  queue = init_queue(size, batch_size, length, dim) if size else {}
  return Objective(
      loss_fn=lambda model, batch, queue, step, rngs: compute_loss(model, batch, queue, step,
                                                                   loss_config, rngs),
      queue=queue, queue_sharding=lambda mesh: queue_sharding(mesh, queue))


# ---------------------------------------------------------------------------------------------
# Recipes


def _log_weight(weight: float) -> float:
  return math.log(weight) if weight > 0 else losses.NEG_INF


def qsft_loss(model, batch: dict, queue: dict | None = None, rngs=None):
  """Query-side fine-tuning: marginal likelihood of the positive retrieved phrases (Eq. 11), on
  phrase scores plus start-only and end-only scores (as the reference).

  Returns (loss, (metrics, queue unchanged))."""
  q_start, q_end = model.encode_questions(batch["question_input_ids"],
                                          batch["question_attention_mask"], rngs=rngs)
  start = jnp.einsum("bkd,bd->bk", batch["candidate_start"], q_start)
  end = jnp.einsum("bkd,bd->bk", batch["candidate_end"], q_end)
  positive, valid = batch["candidate_positive"], batch["candidate_valid"]
  per_example = (losses.marginal_likelihood_loss(start + end, positive, valid)
                 + losses.marginal_likelihood_loss(start, positive, valid)
                 + losses.marginal_likelihood_loss(end, positive, valid))
  loss = per_example.mean()
  top1 = jnp.take_along_axis(positive, jnp.argmax(jnp.where(valid, start + end, losses.NEG_INF),
                                                  axis=1)[:, None], 1)[:, 0]
  return loss, ({"loss": loss, "top1_positive": top1.mean()}, queue or {})


def _unified(model, batch, encoded, queue, queue_on, loss_config, rngs):
  """Per-example unified loss (Kim et al. Eq. 2), start and end averaged (per question of a
  passage-grouped batch)."""
  h, q_start, q_end = encoded["h"], encoded["q_start"], encoded["q_end"]
  b, length, dim = h.shape
  lw_prb = _log_weight(loss_config.lambda_prb or loss_config.lambda_inb)
  extra = [(queue["vectors"].reshape(-1, dim),
            (queue["mask"] & queue_on[:, None, None]).reshape(-1),
            jnp.repeat(queue["passage_ids"].reshape(-1), length),
            jnp.full(queue["mask"].size, lw_prb))]
  if "hard_input_ids" in batch:  # mined hard-negative passages, encoded with gradient
    hard = model.encode_phrases(batch["hard_input_ids"], batch["hard_attention_mask"], rngs=rngs)
    extra.append((hard.reshape(-1, dim), batch["hard_context_mask"].reshape(-1),
                  jnp.repeat(batch["hard_passage_ids"], length),
                  jnp.full(batch["hard_context_mask"].size,
                           _log_weight(loss_config.lambda_hard))))
  vectors, extra_mask, extra_pids, extra_lw = (jnp.concatenate(x) for x in zip(*extra))
  kwargs = dict(log_weight_in_passage=_log_weight(loss_config.lambda_inp),
                log_weight_in_batch=_log_weight(loss_config.lambda_inb),
                query_windows=encoded["windows"])
  mask, pids = encoded["mask"], batch["passage_ids"]
  per_example = 0.5 * (
      losses.unified_loss(q_start, h, mask, batch["start_positions"], pids, vectors, extra_mask,
                          extra_pids, extra_lw, **kwargs)
      + losses.unified_loss(q_end, h, mask, batch["end_positions"], pids, vectors, extra_mask,
                            extra_pids, extra_lw, **kwargs))
  metrics = {}
  if "teacher_start_logits" in batch:  # distillation (the teacher's logits of each question)
    windows, context = encoded["windows"], batch["context_mask"]  # the teacher's tokens
    distill = losses.distillation_loss(encoded["start_logits"], encoded["end_logits"],
                                       batch["teacher_start_logits"], batch["teacher_end_logits"],
                                       context if windows is None else context[windows])
    per_example = per_example + loss_config.lambda_distill * distill
    if windows is None:
      metrics["distill"] = distill.mean()
    else:  # over the filled question slots, as the loss (padding slots repeat or hold zeros)
      valid = batch["question_valid"].astype(jnp.float32)
      metrics["distill"] = (distill * valid).sum() / jnp.maximum(valid.sum(), 1.0)
  return per_example, metrics


def _original(model, batch, encoded, queue, queue_on, loss_config, rngs):
  """Per-example DensePhrases loss: single passage + in-batch/pre-batch (+ distillation)."""
  h, q_start, q_end = encoded["h"], encoded["q_start"], encoded["q_end"]
  if encoded["windows"] is not None:
    raise ValueError("passage-grouped batches (train.questions_per_window > 1) need the unified "
                     "loss")
  b, _, dim = h.shape
  mask, start, end = encoded["mask"], batch["start_positions"], batch["end_positions"]
  pids = batch["passage_ids"]
  single = losses.single_passage_loss(encoded["start_logits"], encoded["end_logits"], mask, start,
                                      end)
  rows = jnp.arange(b)
  qv = queue["vectors"]
  c_rows = jnp.arange(qv.shape[0])[:, None]
  b_rows = jnp.arange(qv.shape[1])[None, :]
  queue_valid = jnp.broadcast_to(queue_on[:, None], queue["passage_ids"].shape).reshape(-1)

  def side(queries, gold, queue_gold):
    # Ids are passages, as in the unified recipe: no token of an example's passage is its
    # negative. (Passage * length + window position named neither the same token seen in two
    # windows of a passage nor told apart two tokens at one position of two windows.)
    queue_vectors = qv[c_rows, b_rows, queue_gold].reshape(-1, dim)
    return losses.in_batch_loss(queries, h[rows, gold], pids, queue_vectors,
                                queue["passage_ids"].reshape(-1), queue_valid)

  negatives = 0.5 * (side(q_start, start, queue["start"]) + side(q_end, end, queue["end"]))
  per_example = loss_config.weight_single * single + loss_config.weight_negatives * negatives
  metrics = {"single": single.mean(), "negatives": negatives.mean()}
  if "teacher_start_logits" in batch:
    distill = losses.distillation_loss(encoded["start_logits"], encoded["end_logits"],
                                       batch["teacher_start_logits"],
                                       batch["teacher_end_logits"], batch["context_mask"])
    per_example = per_example + loss_config.weight_distill * distill
    metrics["distill"] = distill.mean()
  return per_example, metrics


RECIPES = {"unified": _unified, "original": _original}


def teacher_loss(model, batch: dict, queue: dict, step=None, rngs=None):
  """The cross-encoder reader's loss: cross-entropy of the gold start and end over the window's
  context tokens (`losses.single_passage_loss`). Returns (loss, (metrics, queue unchanged))."""
  logits = model.window_logits(batch["cross_input_ids"], batch["cross_attention_mask"],
                               batch["cross_token_type_ids"], batch["cross_align"], rngs=rngs)
  mask, start = batch["context_mask"], batch["start_positions"]
  per_example = losses.single_passage_loss(logits[..., 0], logits[..., 1], mask, start,
                                           batch["end_positions"])
  loss = per_example.mean()
  predicted = jnp.argmax(jnp.where(mask, logits[..., 0], losses.NEG_INF), axis=1)
  return loss, ({"loss": loss, "start_accuracy": (predicted == start).mean()}, queue)


TEACHER_OBJECTIVE = Objective(loss_fn=teacher_loss, queue={}, queue_sharding=lambda mesh: {})


def compute_loss(model, batch: dict, queue: dict, step, loss_config, rngs=None):
  """The configured recipe's loss on one (global) batch.

  Returns:
    (loss scalar, (metrics dict, the queue with this batch pushed)).
  """
  if loss_config.recipe == "qsft":
    return qsft_loss(model, batch, queue, rngs)
  h = model.encode_phrases(batch["input_ids"], batch["attention_mask"], rngs=rngs)  # [B, L, D]
  q_start, q_end = model.encode_questions(batch["question_input_ids"],
                                          batch["question_attention_mask"], rngs=rngs)
  scale = loss_config.score_scale
  if scale != 1.0:  # every phrase score x scale: a softmax temperature (rankings unchanged)
    q_start, q_end = q_start * scale, q_end * scale
  mask, start, end = batch["context_mask"], batch["start_positions"], batch["end_positions"]
  b, length, dim = h.shape
  # Passage-grouped batches: question n belongs to window windows[n] (slots window by window).
  windows = (jnp.repeat(jnp.arange(b), start.shape[0] // b) if "question_valid" in batch
             else None)
  h_questions = h if windows is None else h[windows]  # [B, L, D]: each question's window
  # The candidate tokens: the context, and [CLS] (the target of a window without the answer)
  # when such windows are trained (not of a grouped batch's empty filler windows, passage -1).
  candidates = (mask.at[:, 0].set(batch["passage_ids"] >= 0)
                if loss_config.windows_without_answer else mask)
  encoded = {"h": h, "q_start": q_start, "q_end": q_end, "windows": windows, "mask": candidates,
             "start_logits": jnp.einsum("bld,bd->bl", h_questions, q_start),
             "end_logits": jnp.einsum("bld,bd->bl", h_questions, q_end)}
  # No pre-batch negatives (prebatch_size 0): an empty queue of this shape.
  active = queue or init_queue(0, b, length, dim)
  queue_on = active["valid"] & (step >= loss_config.prebatch_warmup_steps)  # [C]
  if loss_config.recipe not in RECIPES:
    raise ValueError(f"unknown loss recipe {loss_config.recipe!r} (unified or original)")
  per_example, metrics = RECIPES[loss_config.recipe](model, batch, encoded, active, queue_on,
                                                     loss_config, rngs)
  if loss_config.weight_filter:
    if windows is not None:
      raise ValueError("joint filter training does not take passage-grouped batches")
    targets = jnp.arange(length)[None, :]
    filt = losses.filter_loss(model.filter_logits(h), targets == start[:, None],
                              targets == end[:, None], mask)
    per_example = per_example + loss_config.weight_filter * filt
    metrics["filter"] = filt.mean()
  question_mask = candidates if windows is None else candidates[windows]
  predicted = jnp.argmax(jnp.where(question_mask, encoded["start_logits"], losses.NEG_INF), axis=1)
  if windows is None:
    loss = per_example.mean()
    metrics.update(loss=loss, start_accuracy=(predicted == start).mean())
    entry = {"vectors": h, "mask": candidates, "passage_ids": batch["passage_ids"],
             "start": start, "end": end}
  else:  # the mean over the filled question slots; the queue keeps windows (no gold tokens)
    valid = batch["question_valid"].astype(jnp.float32)
    count = jnp.maximum(valid.sum(), 1.0)
    loss = (per_example * valid).sum() / count
    metrics.update(loss=loss, start_accuracy=((predicted == start) * valid).sum() / count,
                   questions=valid.sum())
    entry = {"vectors": h, "mask": candidates, "passage_ids": batch["passage_ids"],
             "start": jnp.zeros(b, jnp.int32), "end": jnp.zeros(b, jnp.int32)}
  return loss, (metrics, push_queue(queue, entry))
