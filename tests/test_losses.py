"""Each loss against a plain-numpy reference, plus the properties the method relies on."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax import losses

RNG = np.random.default_rng(0)
B, L, D, M = 5, 11, 7, 13  # primes, so shape mix-ups show


def _np_lse(x):
  x = np.asarray(x, np.float64)
  m = x.max()
  return m + np.log(np.exp(x - m).sum())


def _np_ce(logits, mask, target):
  return _np_lse(logits[mask]) - logits[target]


def _data():
  q = RNG.normal(size=(B, D)).astype(np.float32)
  h = RNG.normal(size=(B, L, D)).astype(np.float32)
  mask = RNG.random((B, L)) > 0.2
  gold = np.array([int(RNG.choice(np.flatnonzero(m))) for m in mask])
  return q, h, mask, gold


def test_single_passage_matches_numpy():
  s, e = RNG.normal(size=(B, L)), RNG.normal(size=(B, L))
  mask = RNG.random((B, L)) > 0.3
  mask[:, 0] = True
  starts, ends = np.zeros(B, int), np.zeros(B, int)
  ours = losses.single_passage_loss(s, e, mask, starts, ends)
  ref = [0.5 * (_np_ce(s[b], mask[b], 0) + _np_ce(e[b], mask[b], 0)) for b in range(B)]
  np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_padding_is_masked():
  s = RNG.normal(size=(1, L))
  mask = np.arange(L)[None] < 4
  padded = s.copy()
  padded[0, 4:] = 100.0  # huge scores on padding must not matter
  a = losses.single_passage_loss(s, s, mask, np.array([1]), np.array([2]))
  b = losses.single_passage_loss(padded, padded, mask, np.array([1]), np.array([2]))
  np.testing.assert_allclose(a, b, rtol=1e-6)


def test_distillation_matches_numpy_and_is_zero_at_teacher():
  s, e, ts, te = (RNG.normal(size=(B, L)) for _ in range(4))
  mask = RNG.random((B, L)) > 0.3
  mask[:, 0] = True
  ours = losses.distillation_loss(s, e, ts, te, mask, temperature=2.0)

  def kl(st, te_):
    p = np.exp(te_[mask_b] / 2 - _np_lse(te_[mask_b] / 2))
    return np.sum(p * (np.log(p) - (st[mask_b] / 2 - _np_lse(st[mask_b] / 2))))
  ref = []
  for b in range(B):
    mask_b = mask[b]
    ref.append(0.5 * (kl(s[b], ts[b]) + kl(e[b], te[b])))
  np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(losses.distillation_loss(ts, te, ts, te, mask), 0.0, atol=1e-6)


def test_in_batch_matches_numpy():
  q, gold = RNG.normal(size=(B, D)), RNG.normal(size=(B, D))
  extra = RNG.normal(size=(M, D))
  gold_ids = np.array([3, 8, 3, 9, 10])  # examples 0 and 2 share their gold token
  extra_ids = np.arange(100, 100 + M)
  extra_ids[4] = 8  # the queue holds example 1's gold token: not a negative for it
  extra_mask = np.arange(M) < 10  # 3 empty queue slots
  ours = losses.in_batch_loss(q, gold, gold_ids, extra, extra_ids, extra_mask)
  for b in range(B):
    cands = np.concatenate([gold, extra])
    ids = np.concatenate([gold_ids, extra_ids])
    ok = np.concatenate([np.ones(B, bool), extra_mask])
    ok &= ~((ids == gold_ids[b]) & (np.arange(B + M) != b))
    logits = cands @ q[b]
    np.testing.assert_allclose(ours[b], _np_ce(logits, ok, b), rtol=1e-5)


def _np_unified(q, h, mask, gold, pids, extra, extra_mask, extra_pids, extra_lw, lw_inp, lw_inb):
  out = []
  for b in range(len(q)):
    terms = [q[b] @ h[b, gold[b]]]
    for b2 in range(len(q)):
      if b2 != b and pids[b2] == pids[b]:
        continue
      for t in range(h.shape[1]):
        if not mask[b2, t] or (b2 == b and t == gold[b]):
          continue
        terms.append(q[b] @ h[b2, t] + (lw_inp if b2 == b else lw_inb))
    if extra is not None:
      for m in range(len(extra)):
        if extra_mask[m] and extra_pids[m] != pids[b]:
          terms.append(q[b] @ extra[m] + extra_lw[m])
    out.append(_np_lse(terms) - terms[0])
  return np.array(out)


def test_unified_matches_numpy():
  q, h, mask, gold = _data()
  pids = np.array([0, 1, 2, 1, 4])  # examples 1 and 3 share a passage window
  extra = RNG.normal(size=(M, D)).astype(np.float32)
  extra_mask = RNG.random(M) > 0.2
  extra_pids = np.array([7] * 6 + [0] * 2 + [9] * 5)  # 2 queue tokens are from passage 0
  extra_lw = np.where(np.arange(M) < 8, math.log(256.0), 0.0)
  ours = losses.unified_loss(q, h, mask, gold, pids, extra, extra_mask, extra_pids, extra_lw,
                             log_weight_in_passage=0.0, log_weight_in_batch=math.log(256.0))
  ref = _np_unified(q, h, mask, gold, pids, extra, extra_mask, extra_pids, extra_lw, 0.0,
                    math.log(256.0))
  np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_unified_with_unit_weights_and_only_in_passage_equals_single_passage():
  q, h, mask, gold = _data()
  pids = np.arange(B)
  unified = losses.unified_loss(q, h, mask, gold, pids, log_weight_in_passage=0.0,
                                log_weight_in_batch=losses.NEG_INF)
  logits = np.einsum("bd,bld->bl", q, h)
  single = losses._cross_entropy(logits, mask, gold)
  np.testing.assert_allclose(unified, single, rtol=1e-5)
  # And with start and end both: the single-passage loss is their mean.
  both = 0.5 * (unified + unified)
  np.testing.assert_allclose(both, losses.single_passage_loss(logits, logits, mask, gold, gold),
                             rtol=1e-5)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_weight_n_equals_negatives_duplicated_n_times(n):
  q, h, mask, gold = _data()
  pids = np.arange(B)
  extra = RNG.normal(size=(M, D)).astype(np.float32)
  extra_mask = np.ones(M, bool)
  weighted = losses.unified_loss(q, h, mask, gold, pids, extra, extra_mask, np.full(M, 99),
                                 np.full(M, math.log(n)), log_weight_in_passage=math.log(n),
                                 log_weight_in_batch=math.log(n))
  # Duplicate every negative n times with weight 1: in-passage and in-batch tokens by repeating
  # the other passages' tokens and the question's own non-gold tokens as extra vectors.
  dup_vectors = [np.repeat(extra, n, axis=0)]
  results = []
  for b in range(B):
    own_neg = np.array([h[b, t] for t in range(L) if mask[b, t] and t != gold[b]])
    others = np.array([h[b2, t] for b2 in range(B) for t in range(L) if b2 != b and mask[b2, t]])
    cands = np.concatenate([np.repeat(own_neg, n, axis=0), np.repeat(others, n, axis=0),
                            dup_vectors[0]])
    terms = np.concatenate([[q[b] @ h[b, gold[b]]], cands @ q[b]])
    results.append(_np_lse(terms) - terms[0])
  np.testing.assert_allclose(weighted, results, rtol=1e-5)


def test_filter_loss_matches_numpy():
  logits = RNG.normal(size=(B, L, 2))
  st, en = RNG.random((B, L)) > 0.7, RNG.random((B, L)) > 0.7
  mask = RNG.random((B, L)) > 0.2
  ours = losses.filter_loss(logits, st, en, mask)
  sig = 1 / (1 + np.exp(-logits))
  t = np.stack([st, en], -1)
  bce = -(t * np.log(sig) + (1 - t) * np.log(1 - sig))
  ref = (bce * mask[..., None]).sum((1, 2)) / (2 * mask.sum(1))
  np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_marginal_likelihood_matches_numpy():
  scores = RNG.normal(size=(B, M))
  pos = RNG.random((B, M)) > 0.6
  valid = RNG.random((B, M)) > 0.1
  pos[2] = False  # no positive: contributes nothing
  ours = losses.marginal_likelihood_loss(scores, pos, valid)
  for b in range(B):
    p = pos[b] & valid[b]
    ref = 0.0 if not p.any() else _np_lse(scores[b][valid[b]]) - _np_lse(scores[b][p])
    np.testing.assert_allclose(ours[b], ref, rtol=1e-5, atol=1e-7)
  # A single positive reduces the MML to cross-entropy.
  one = np.zeros((B, M), bool)
  one[:, 3] = True
  np.testing.assert_allclose(losses.marginal_likelihood_loss(scores, one, np.ones_like(one)),
                             [_np_ce(scores[b], np.ones(M, bool), 3) for b in range(B)],
                             rtol=1e-5)


def test_gradients_finite_for_fully_masked_rows():
  q, h, mask, gold = _data()
  mask[1] = False  # a row with no candidate at all
  pids = np.arange(B)
  none = np.zeros((B, L), bool)

  def total(q, h):
    logits = jnp.einsum("bd,bld->bl", q, h)
    return (losses.single_passage_loss(logits, logits, mask, gold, gold).sum()
            + losses.unified_loss(q, h, mask, gold, pids).sum()
            + losses.distillation_loss(logits, logits, logits * 2, logits, none).sum()
            + losses.filter_loss(h[..., :2], none, none, none).sum()
            + losses.marginal_likelihood_loss(logits, none, mask).sum()
            + losses.in_batch_loss(q, h[:, 0], np.zeros(B, int)).sum())

  values = jax.grad(total, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(h))
  assert all(np.isfinite(np.asarray(v)).all() for v in values)
  logits = jnp.einsum("bd,bld->bl", q, h)
  assert float(losses.single_passage_loss(logits, logits, mask, gold, gold)[1]) == 0.0
  assert np.isfinite(np.asarray(losses.unified_loss(q, h, mask, gold, pids))).all()


def test_original_recipe_never_takes_a_token_of_the_examples_passage_as_a_negative():
  """The original recipe's in-batch / pre-batch ids are passages (as the unified recipe's): the
  same answer token seen in two windows of its passage (two examples, the gold vector at other
  window positions) is not a negative of either, and neither is any token of that passage."""
  from types import SimpleNamespace

  from dpjax import objectives
  length, dim = 4, 2
  h = np.zeros((3, length, dim), np.float32)
  h[0, 1] = h[1, 3] = [10.0, 0.0]  # one token of passage 7, in two windows
  h[2, 1] = [0.0, 10.0]  # passage 9's gold, at window position 1 like example 0's
  q = np.float32([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
  batch = {"context_mask": np.ones((3, length), bool), "passage_ids": np.int32([7, 7, 9]),
           "start_positions": np.int32([1, 3, 1]), "end_positions": np.int32([1, 3, 1])}
  encoded = {"h": jnp.asarray(h), "q_start": jnp.asarray(q), "q_end": jnp.asarray(q),
             "start_logits": jnp.zeros((3, length)), "end_logits": jnp.zeros((3, length)),
             "windows": None, "mask": jnp.asarray(batch["context_mask"])}
  queue = objectives.init_queue(1, 3, length, dim)
  config = SimpleNamespace(weight_single=0.0, weight_negatives=1.0)
  per_example, metrics = objectives._original(None, batch, encoded, queue, jnp.zeros(1, bool),
                                               config, None)
  # each its own logit 10 against one at 0 (examples 0, 1: the other passage) or two (example 2);
  # with window-position ids example 1 was example 0's negative at 10 (loss log 2)
  want = [math.log1p(math.exp(-10.0))] * 2 + [math.log1p(2 * math.exp(-10.0))]
  np.testing.assert_allclose(per_example, want, rtol=0, atol=2e-6)  # float32 sums at 10
