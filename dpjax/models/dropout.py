"""Dropout with a counter-based hash mask: the interface of `nnx.Dropout`, cheaper masks.

`jax.random.bernoulli` draws every mask element through threefry: on a CPU the attention dropout
mask of one layer costs more than the layer's matrix products (results/code_measurements.md).
Here one threefry draw per call makes a 64-bit seed, and each element's 32 random bits are a
hash of its index in the (global) array and that seed,
`mix(mix(index ^ seed0) + seed1)` with `mix` the lowbias32 integer finalizer (C. Wellons' hash
prospector; full avalanche, bias ~0.1 of murmur3's): far cheaper for the same mask, elementwise,
so XLA can fuse it into its consumer (unmeasured on an accelerator).

For one seed the map index -> bits is a bijection of uint32, like a counter-based generator
(Philox) under one key; two seeds give unrelated masks. The index is the element's position in
the global array, built from broadcasted iotas, so a mask does not depend on how the array is
sharded (data-parallel over N devices draws the masks of one device). Arrays of 2**32 elements
or more fall back to `jax.random.bernoulli`. Keep probability: 1 - round(rate * 2**32) / 2**32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_U32 = 2 ** 32


def _mix(x: jax.Array) -> jax.Array:
  """lowbias32: a bijective uint32 -> uint32 finalizer with full avalanche."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x21F0AAAD)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x735A2D97)
  return x ^ (x >> 15)


def element_index(shape: tuple[int, ...]) -> jax.Array:
  """Each element's row-major position in an array of `shape` (uint32; size < 2**32)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    if shape[axis] > 1:
      index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride *= shape[axis]
  return index


def hash_bits_at(index: jax.Array, seed0: jax.Array, seed1: jax.Array) -> jax.Array:
  """The 32 pseudo-random bits of the elements at row-major positions `index` (uint32) under
  the seed (seed0, seed1): what `hash_bits` gives there (and the flash-attention kernel uses)."""
  return _mix(_mix(index ^ seed0) + seed1)


def hash_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """32 pseudo-random bits per element of `shape` from `seed` (uint32[2])."""
  return hash_bits_at(element_index(shape), seed[0], seed[1])


def mask_seed(key: jax.Array) -> jax.Array:
  """The uint32[2] seed of a mask drawn with `key` (one threefry draw)."""
  return jax.random.bits(key, (2,), jnp.uint32)


def drop_threshold(rate: float) -> np.uint32:
  """An element is kept where its bits are >= this: probability 1 - round(rate 2**32) / 2**32."""
  return np.uint32(min(round(rate * _U32), _U32 - 1))


def keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """True where an element is kept (probability 1 - rate) under `key` (a jax.random key)."""
  if math.prod(shape) >= _U32:
    return jax.random.bernoulli(key, 1.0 - rate, shape)
  return hash_bits(mask_seed(key), shape) >= drop_threshold(rate)


def dropped(key: jax.Array, x: jax.Array, rate: float) -> jax.Array:
  """`x` with the elements `keep_mask(key, x.shape, rate)` drops zeroed and the others scaled by
  1 / (1 - rate): what `Dropout` computes with that key."""
  keep = keep_mask(key, x.shape, rate)
  # Scaled in float32: in bfloat16 1 - 0.1 rounds to 0.8984375, an expected value 1.0017 x.
  scaled = (x.astype(jnp.float32) / jnp.float32(1.0 - rate)).astype(x.dtype)
  return jnp.where(keep, scaled, jnp.zeros_like(x))


class Dropout(nnx.Module):
  """`nnx.Dropout(rate)` with `keep_mask`'s hash masks; same call: `(x, deterministic=, rngs=)`
  (the key comes from the `dropout` stream of `rngs`)."""

  def __init__(self, rate: float, *, rng_collection: str = "dropout"):
    if not 0.0 <= rate <= 1.0:
      raise ValueError(f"dropout rate {rate} is not in [0, 1]")
    self.rate = rate
    self.rng_collection = rng_collection

  def __call__(self, x: jax.Array, *, deterministic: bool = False,
               rngs: nnx.Rngs | None = None) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    if self.rate == 1.0:
      return jnp.zeros_like(x)
    if rngs is None:
      raise ValueError("Dropout needs `rngs` (with a 'dropout' stream) when not deterministic")
    return dropped(rngs[self.rng_collection](), x, self.rate)

  def seed(self, rngs: nnx.Rngs) -> jax.Array:
    """The seed of the mask this call would draw next (it takes the same key from `rngs`): a
    kernel that makes the mask itself (`dpjax.models.flash_attention`) drops what `__call__`
    on an array of < 2**32 elements would."""
    return mask_seed(rngs[self.rng_collection]())
