"""Span decoding and batched encoding (no padding may leak)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
  assert [r.tolist() for r, _ in outputs] == [list(range(8)), list(range(8, 13))]
  doubled = np.concatenate([o[0] for _, o in outputs])
  np.testing.assert_array_equal(doubled, rows * 2)
  assert sum(len(o[1]) for _, o in outputs) == 13


def test_map_batches_pads_small_batches_only_to_a_power_of_two():
  @jax.jit
  def padded_size(x):
    return jnp.full(len(x), len(x))

  for devices, total, sizes in [(1, 70, [64, 8]), (1, 1, [1]), (2, 5, [8]), (8, 13, [8, 8]),
                                (2, 3, [4]), (1, 33, [64])]:
    mesh = make_mesh(devices)
    outputs = list(map_batches(padded_size, [np.zeros((total, 2))], 64 if devices < 8 else 8,
                               mesh))
    assert [int(o[0]) for _, o in outputs] == sizes, (devices, total)
    assert sum(len(o) for _, o in outputs) == total


def test_map_batches_by_length_cuts_each_batch_to_its_longest_row():
  mesh = make_mesh(2)
  lengths = np.array([3, 17, 9, 40, 1, 33, 16, 5, 64])
  ids = np.zeros((9, 64), np.int32)
  for r, n in enumerate(lengths):
    ids[r, :n] = r + 1  # row r: its number in the first n columns, padding after

  @jax.jit
  def fn(ids, flags):
    return ids * 2, flags + 1

  flags = np.arange(9)
  seen, widths = [], []
  for rows, (doubled, flag) in map_batches(fn, [ids, flags], 4, mesh, lengths=lengths,
                                           length_multiple=16):
    np.testing.assert_array_equal(doubled, ids[rows, :doubled.shape[1]] * 2)
    np.testing.assert_array_equal(flag, flags[rows] + 1)  # 1-D arrays are not cut
    assert lengths[rows].max() <= doubled.shape[1] < lengths[rows].max() + 16
    seen += rows.tolist()
    widths.append(doubled.shape[1])
  assert seen == np.argsort(-lengths, kind="stable").tolist()  # longest first, each row once
  assert widths == [64, 16, 16]
  with pytest.raises(ValueError, match="lengths has shape"):
    next(map_batches(fn, [ids, flags], 4, mesh, lengths=lengths[:3]))
