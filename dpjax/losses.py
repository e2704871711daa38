"""Training objectives of DensePhrases and of Kim et al. (2022), as pure array functions.

Every function takes and returns jax arrays only (jax / jax.numpy, no models, no data code), is
jit- and grad-friendly, respects its masks, and returns one value per example so callers choose
how to reduce. A masked-out candidate gets the finite logit `NEG_INF` (not -inf), so rows with
no valid candidate give finite values and finite (zero) gradients rather than NaN.

Notation: B questions, L tokens per passage, D vector size, M extra negative vectors.
Phrase score = q_start . h_i + q_end . h_j, so start and end are separate softmax problems over
token vectors; each loss handles one side (`dpjax.objectives` averages the two).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = -1e9


def _masked(logits, mask):
  return jnp.where(mask, logits, NEG_INF)


def _cross_entropy(logits, mask, target):
  """-log softmax(logits)[target] over the masked candidates; 0 where the target is invalid.

  Args:
    logits: [B, N] float.
    mask: [B, N] bool, valid candidates.
    target: [B] int, index of the positive candidate.
  Returns:
    [B] float32.
  """
  logits = _masked(logits.astype(jnp.float32), mask)
  gold = jnp.take_along_axis(logits, target[:, None], axis=1)[:, 0]
  valid = jnp.take_along_axis(mask, target[:, None], axis=1)[:, 0]
  loss = jax.nn.logsumexp(logits, axis=1) - gold
  return jnp.where(valid, loss, 0.0)


def single_passage_loss(start_logits, end_logits, mask, start_positions, end_positions):
  """In-passage negatives: softmax over the tokens of the question's own passage.

  Args:
    start_logits, end_logits: [B, L] scores q_start . h_t and q_end . h_t.
    mask: [B, L] bool, tokens that may be an answer boundary (padding excluded: the reference
      implementation forgot this).
    start_positions, end_positions: [B] int gold token indices.

  Returns:
    [B] float32, the mean of the start and end cross-entropies.
  """
  start = _cross_entropy(start_logits, mask, start_positions)
  end = _cross_entropy(end_logits, mask, end_positions)
  return 0.5 * (start + end)


def distillation_loss(start_logits, end_logits, teacher_start_logits, teacher_end_logits, mask,
                      temperature: float = 1.0):
  """KL(teacher || student) of the start and end distributions over the passage tokens.

  Args:
    start_logits, end_logits: [B, L] student (dual encoder) scores.
    teacher_start_logits, teacher_end_logits: [B, L] cross-encoder scores (no gradient flows).
    mask: [B, L] bool.
    temperature: softens both distributions.

  Returns:
    [B] float32, the mean of the start and end KL divergences.
  """
  def kl(student, teacher):
    teacher = jax.lax.stop_gradient(teacher.astype(jnp.float32))
    log_p = jax.nn.log_softmax(_masked(teacher / temperature, mask), axis=-1)
    log_q = jax.nn.log_softmax(_masked(student.astype(jnp.float32) / temperature, mask), axis=-1)
    return jnp.sum(jnp.where(mask, jnp.exp(log_p) * (log_p - log_q), 0.0), axis=-1)

  return 0.5 * (kl(start_logits, teacher_start_logits) + kl(end_logits, teacher_end_logits))


def in_batch_loss(queries, gold_vectors, gold_ids, extra_vectors=None, extra_ids=None,
                  extra_mask=None):
  """In-batch (and pre-batch) negatives of DensePhrases, for one side (start or end).

  Question b's positive is its gold token vector; its negatives are the gold token vectors of
  the other examples and the `extra_vectors` (pre-batch negatives: gold tokens of previous
  batches, no gradient). A negative with the same id as the positive (e.g. the same passage:
  `objectives`' original recipe) is not a negative and is masked.

  Args:
    queries: [B, D] q_start (or q_end).
    gold_vectors: [B, D] h at each example's gold start (or end) token.
    gold_ids: [B] int, an id of each gold token (e.g. its passage's).
    extra_vectors: [M, D] or None.
    extra_ids: [M] int ids of the extra vectors.
    extra_mask: [M] bool, valid extra vectors (an empty queue slot is invalid).

  Returns:
    [B] float32 cross-entropy with the positive at index b.
  """
  candidates, ids = gold_vectors, gold_ids
  mask = jnp.ones((queries.shape[0], gold_vectors.shape[0]), bool)
  if extra_vectors is not None:
    candidates = jnp.concatenate([gold_vectors, jax.lax.stop_gradient(extra_vectors)])
    ids = jnp.concatenate([gold_ids, extra_ids])
    extra = jnp.broadcast_to(extra_mask[None, :], (queries.shape[0], extra_mask.shape[0]))
    mask = jnp.concatenate([mask, extra], axis=1)
  logits = jnp.einsum("bd,nd->bn", queries, candidates, preferred_element_type=jnp.float32)
  own = jnp.arange(queries.shape[0])
  duplicate = (ids[None, :] == gold_ids[:, None]) & (jnp.arange(ids.shape[0])[None, :]
                                                     != own[:, None])
  return _cross_entropy(logits, mask & ~duplicate, own)


def unified_loss(queries, passage_vectors, passage_mask, gold_positions, passage_ids,
                 extra_vectors=None, extra_mask=None, extra_passage_ids=None,
                 extra_log_weights=None, *, log_weight_in_passage: float = 0.0,
                 log_weight_in_batch: float = math.log(256.0), query_windows=None):
  """The unified loss of Kim et al. (2022, Eq. 2) for one side (start or end).

  One softmax per question over its gold token p+ and all negatives p-, each weighted by
  lambda(p-):  -log e^{s+} / (e^{s+} + sum_{p-} lambda(p-) e^{s(p-)}),  with lambda e^s computed
  as e^{s + log lambda}. Negatives: the other tokens of the gold passage (in-passage,
  `log_weight_in_passage`), all tokens of the other passages of the batch (in-batch,
  `log_weight_in_batch`), and `extra_vectors` (tokens of pre-batch and hard-negative passages,
  each with its own log-weight, no gradient for pre-batch vectors is the caller's choice).
  Tokens of a passage with the same id as the question's gold passage are never negatives
  (another example of the same window, or the same passage in the pre-batch queue).

  With `query_windows`, several questions share a window (passage-grouped batches): question n's
  gold window is row `query_windows[n]` of the W windows, and the other windows of the batch are
  its in-batch negatives (those of its own passage excepted).

  Args:
    queries: [B, D] (B = N questions with `query_windows`).
    passage_vectors: [B, L, D] token vectors of each example's gold passage window ([W, L, D]
      with `query_windows`).
    passage_mask: [B, L] bool, candidate tokens (context tokens, no padding).
    gold_positions: [B] int gold token index within the example's passage.
    passage_ids: [B] int passage ids of the windows.
    extra_vectors: [M, D] or None.
    extra_mask: [M] bool.
    extra_passage_ids: [M] int.
    extra_log_weights: [M] float, log lambda of each extra vector.
    log_weight_in_passage: log lambda_inp (0.0 means lambda = 1).
    log_weight_in_batch: log lambda_inb; -inf-like values (e.g. NEG_INF) switch in-batch off.
    query_windows: [N] int window row of each question, or None (question b's window is b).

  Returns:
    [B] float32.
  """
  b, length, _ = passage_vectors.shape
  windows = jnp.arange(b) if query_windows is None else query_windows  # [N]
  query_passage_ids = passage_ids if query_windows is None else passage_ids[query_windows]
  flat = passage_vectors.reshape(b * length, -1)
  logits = jnp.einsum("bd,nd->bn", queries, flat, preferred_element_type=jnp.float32)
  column_example = jnp.repeat(jnp.arange(b), length)  # [W*L] window of each column
  own = column_example[None, :] == windows[:, None]  # [N, W*L]
  same_passage = passage_ids[column_example][None, :] == query_passage_ids[:, None]
  mask = passage_mask.reshape(-1)[None, :] & (own | ~same_passage)
  gold_column = windows * length + gold_positions
  is_gold = jnp.arange(b * length)[None, :] == gold_column[:, None]
  log_weights = jnp.where(own, log_weight_in_passage, log_weight_in_batch)
  log_weights = jnp.where(is_gold, 0.0, log_weights)
  logits = logits + log_weights
  if extra_vectors is not None:
    extra_logits = jnp.einsum("bd,md->bm", queries, extra_vectors,
                              preferred_element_type=jnp.float32)
    extra_ok = extra_mask[None, :] & (extra_passage_ids[None, :] != query_passage_ids[:, None])
    logits = jnp.concatenate([logits, extra_logits + extra_log_weights[None, :]], axis=1)
    mask = jnp.concatenate([mask, extra_ok], axis=1)
  return _cross_entropy(logits, mask, gold_column)


def filter_loss(filter_logits, start_targets, end_targets, mask):
  """Token-filter binary cross-entropy (is this token an answer start / end?).

  Args:
    filter_logits: [B, L, 2] start and end logits of the filter head.
    start_targets, end_targets: [B, L] {0, 1}.
    mask: [B, L] bool, tokens that count.

  Returns:
    [B] float32, the mean over valid tokens of the start and end BCE (0 for empty rows).
  """
  logits = filter_logits.astype(jnp.float32)
  targets = jnp.stack([start_targets, end_targets], axis=-1).astype(jnp.float32)
  # log(1 + e^x) - t x, the numerically stable form of BCE with logits.
  bce = jax.nn.softplus(logits) - targets * logits
  bce = jnp.where(mask[..., None], bce, 0.0).sum(axis=(1, 2))
  return bce / jnp.maximum(2.0 * mask.sum(axis=1), 1.0)


def marginal_likelihood_loss(scores, positive_mask, valid_mask):
  """Query-side fine-tuning (Eq. 11): -log sum over positives of softmax(scores).

  Args:
    scores: [B, K] scores of the retrieved candidates.
    positive_mask: [B, K] bool, candidates that match a gold answer (or gold document).
    valid_mask: [B, K] bool, retrieved candidates (padding excluded).

  Returns:
    [B] float32; 0 with zero gradient for examples without any valid positive.
  """
  scores = scores.astype(jnp.float32)
  positive_mask = positive_mask & valid_mask
  total = jax.nn.logsumexp(_masked(scores, valid_mask), axis=1)
  positive = jax.nn.logsumexp(_masked(scores, positive_mask), axis=1)
  return jnp.where(positive_mask.any(axis=1), total - positive, 0.0)
