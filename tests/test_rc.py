"""Span decoding and batched encoding (no padding may leak)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.parallel import make_mesh, map_batches
from dpjax.rc import best_spans


def test_best_spans_matches_brute_force():
  rng = np.random.default_rng(0)
  rows, length, max_len = 7, 13, 5
  s, e = rng.normal(size=(rows, length)), rng.normal(size=(rows, length))
  s_ok, e_ok = rng.random((rows, length)) > 0.3, rng.random((rows, length)) > 0.3
  s_ok[3], e_ok[4] = False, False  # rows without any allowed span
  start, end, score = best_spans(s, e, s_ok, e_ok, max_len)
  for r in range(rows):
    spans = [(s[r, i] + e[r, j], i, j) for i, j in itertools.product(range(length), repeat=2)
             if s_ok[r, i] and e_ok[r, j] and i <= j < i + max_len]
    if not spans:
      assert score[r] == -np.inf
      continue
    best = max(spans)
    assert (start[r], end[r]) == best[1:]
    np.testing.assert_allclose(score[r], best[0], rtol=1e-6)


def test_map_batches_drops_padding_and_shards():
  assert jax.device_count() == 8
  mesh = make_mesh()
  rows = np.arange(13 * 3, dtype=np.float32).reshape(13, 3)

  @jax.jit
  def fn(x):
    return x * 2, jnp.ones(len(x))

  outputs = list(map_batches(fn, [rows], 8, mesh))
  assert [r for r, _ in outputs] == [slice(0, 8), slice(8, 13)]
  doubled = np.concatenate([o[0] for _, o in outputs])
  np.testing.assert_array_equal(doubled, rows * 2)
  assert sum(len(o[1]) for _, o in outputs) == 13
