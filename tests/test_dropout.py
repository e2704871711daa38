"""The hash-mask dropout: rate, scaling, independence, determinism, sharding-invariance."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpjax.models.dropout import Dropout, _mix, element_index, hash_bits, keep_mask

SHAPE = (8, 4, 96, 96)  # 294,912 elements


def _mask(seed: int, shape=SHAPE, rate=0.1) -> np.ndarray:
  return np.asarray(keep_mask(jax.random.key(seed), shape, rate))


def test_element_index_is_row_major_position():
  shape = (3, 1, 5, 7)
  np.testing.assert_array_equal(element_index(shape), np.arange(105).reshape(shape))


def test_mix_is_a_bijection_on_a_sample():
  x = jnp.arange(1 << 20, dtype=jnp.uint32) * jnp.uint32(4093)
  assert len(np.unique(np.asarray(_mix(x)))) == 1 << 20


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_rate(rate):
  kept = np.concatenate([_mask(seed, rate=rate).ravel() for seed in range(4)])
  sd = np.sqrt(rate * (1 - rate) / kept.size)
  assert abs(kept.mean() - (1 - rate)) < 5 * sd


def test_bits_are_uniform_bytes():
  bits = np.asarray(hash_bits(jnp.array([12345, 678], jnp.uint32), SHAPE)).ravel()
  for shift in (0, 8, 16, 24):  # each byte of the 32 bits: chi-square over 256 cells
    counts = np.bincount((bits >> shift) & 0xFF, minlength=256)
    expected = bits.size / 256
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 255 + 6 * np.sqrt(2 * 255), (shift, chi2)  # mean 255, sd ~22.6


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
  a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
  return float(np.corrcoef(a, b)[0, 1])


def test_masks_are_uncorrelated_across_seeds_and_neighbours():
  a, b = _mask(1), _mask(2)
  bound = 5 / np.sqrt(a.size)  # 5 sd of the correlation of independent masks
  assert abs(_correlation(a, b)) < bound
  assert (a != b).any()
  for axis in range(a.ndim):  # neighbouring elements along every axis
    if a.shape[axis] > 1:
      head = np.take(a, range(a.shape[axis] - 1), axis=axis)
      tail = np.take(a, range(1, a.shape[axis]), axis=axis)
      assert abs(_correlation(head, tail)) < 5 / np.sqrt(head.size), axis
  # consecutive seeds (one stream's successive keys) and the same mask shifted by one row
  assert abs(_correlation(a[1:], _mask(1)[:-1])) < bound


def test_same_key_same_mask_and_scaling():
  x = jnp.ones(SHAPE)
  layer = Dropout(0.25)
  one = layer(x, rngs=nnx.Rngs(dropout=3))
  np.testing.assert_array_equal(one, layer(x, rngs=nnx.Rngs(dropout=3)))
  values = np.unique(np.asarray(one))
  np.testing.assert_allclose(values, [0.0, 1 / 0.75], rtol=1e-6)
  rngs = nnx.Rngs(dropout=3)
  assert not np.array_equal(layer(x, rngs=rngs), layer(x, rngs=rngs))  # the stream advances
  np.testing.assert_array_equal(layer(x, deterministic=True, rngs=rngs), x)
  np.testing.assert_array_equal(Dropout(0.0)(x, rngs=rngs), x)
  np.testing.assert_array_equal(Dropout(1.0)(x, rngs=rngs), np.zeros(SHAPE))
  with pytest.raises(ValueError, match="needs `rngs`"):
    layer(x)
  with pytest.raises(ValueError, match="not in"):
    Dropout(1.5)


def test_mask_does_not_depend_on_sharding():
  assert jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  x = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE) + 1
  key = jax.random.key(7)
  drop = jax.jit(lambda x, key: jnp.where(keep_mask(key, x.shape, 0.1), x, 0))
  one = np.asarray(drop(x, key))
  eight = drop(jax.device_put(x, sharded), key)
  assert len(eight.sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(eight), one)


def test_large_arrays_fall_back_to_threefry():
  def program(shape):  # traced only: nothing of 2**32 elements is made
    return str(jax.make_jaxpr(lambda key: keep_mask(key, shape, 0.1))(jax.random.key(0)))
  assert "iota" in program((1 << 15, 1 << 16))  # the hash of the element index
  big = program((1 << 16, 1 << 16))  # 2**32 elements: the index would wrap
  assert "iota" not in big and "random_bits" in big and "bool[65536,65536]" in big


def test_bfloat16_dropout_keeps_the_expected_value():
  """Kept bfloat16 values are x / (1 - rate) scaled in float32: dividing by bfloat16's
  0.8984375 (1 - 0.1 rounded) made the expected value 1.0017 x."""
  from dpjax.models.dropout import dropped
  x = jax.random.normal(jax.random.key(1), (200_000,), jnp.float32).astype(jnp.bfloat16)
  out = np.asarray(dropped(jax.random.key(2), x, 0.1), np.float32)
  kept = out != 0
  ratio = out[kept] / np.asarray(x, np.float32)[kept]
  assert abs(float(ratio.mean()) - 1 / 0.9) < 2e-4  # (was 1 / 0.8984375: 1.9e-3 off)
