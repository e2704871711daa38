"""Span decoding and batched encoding (no padding may leak)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpjax.parallel import call_shapes, make_mesh, map_batches
from dpjax.reading import best_spans


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


def test_call_shapes_are_the_shapes_map_batches_calls_with():
  """`call_shapes` (what is compiled ahead) gives exactly the (rows, width) of `map_batches`'
  calls: padded last batches, widths rounded up and cut to the arrays' own width."""
  rng = np.random.default_rng(3)
  calls = []  # each shape fn is traced for (a new fn per case)

  for devices, total, batch, multiple, width, pad_last in [(1, 70, 16, 32, 100, False),
                                                           (2, 9, 4, 16, 64, True),
                                                           (8, 13, 8, 7, 20, False),
                                                           (1, 1, 64, 8, 5, False)]:
    mesh = make_mesh(devices)
    lengths = rng.integers(1, width + 1, total)
    calls.clear()
    fn = jax.jit(lambda ids: calls.append(ids.shape) or ids)
    for _ in map_batches(fn, [np.zeros((total, width), np.int32)], batch, mesh,
                         lengths=lengths, length_multiple=multiple, pad_last=pad_last):
      pass
    assert call_shapes(lengths, width, batch, mesh, length_multiple=multiple,
                       pad_last=pad_last) == sorted(set(calls)), (devices, total)


def test_map_batches_on_one_device_passes_numpy_and_equals_the_sharded_path():
  """On one device of one process the padded numpy batch goes to jit as it is (no global
  array is built); the outputs, rows and padding cut are those of the sharded path."""
  rng = np.random.default_rng(0)
  ids, mask = rng.integers(0, 100, (21, 40)).astype(np.int32), np.ones((21, 40), np.int32)
  lengths = rng.integers(1, 41, 21)
  seen_types = []

  def fn(ids, mask):
    seen_types.append(isinstance(ids, jax.Array) or type(ids))
    return jitted(ids, mask)

  jitted = jax.jit(lambda ids, mask: (ids * 3 + mask, ids.sum(1)))
  runs = {}
  for devices in (1, 8):
    seen_types.clear()
    runs[devices] = list(map_batches(fn, [ids, mask], 8, make_mesh(devices), lengths=lengths,
                                     length_multiple=16, pad_last=True))
    assert set(seen_types) == ({np.ndarray} if devices == 1 else {True}), devices
  for (rows1, out1), (rows8, out8) in zip(runs[1], runs[8], strict=True):
    np.testing.assert_array_equal(rows1, rows8)
    for a, b in zip(out1, out8, strict=True):
      assert a.shape[0] == len(rows1)  # padding rows cut
      np.testing.assert_array_equal(a, b)
