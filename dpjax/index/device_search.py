"""Exact inner-product search on the accelerator: a faiss `IndexFlatIP` stand-in in JAX.

On a GPU or TPU machine the host's faiss scan is what an exact (Flat) search waits on, while
the same scan is matrix products that the accelerator runs far faster
(results/code_measurements.md).
`DeviceFlat` keeps the float16 token vectors on the process's devices (rows sharded over them),
scores a chunk of queries against them block by block in float32, keeps a running top-k per
device and merges the devices' top-k: the (scores, labels) that faiss's `search` returns, up to
the order of exact ties and float32 rounding of near-ties (sums in another order).

`use_device_search` decides where a Flat index is searched (`index.search_device`): "faiss" on
the host, "jax" on the devices, "auto" (default) on the devices when they are accelerators and
hold the vectors in at most half their memory.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpjax.parallel import make_mesh

SEARCH_DEVICES = ("auto", "faiss", "jax")
QUERY_CHUNK = 256  # queries per compiled call (a shorter last chunk is padded to it)
BLOCK_ROWS = 32768  # vectors scored at a time per device: [QUERY_CHUNK, BLOCK_ROWS] float32
MIN_K = 16  # k is rounded up to a power of two >= MIN_K: a few compiled shapes serve all k


def use_device_search(choice: str, num_bytes: int) -> bool:
  """Whether a Flat index of `num_bytes` of float16 vectors is searched by `DeviceFlat`."""
  if choice not in SEARCH_DEVICES:
    raise ValueError(f"index.search_device must be one of {SEARCH_DEVICES}, got {choice!r}")
  if choice != "auto":
    return choice == "jax"
  devices = jax.local_devices()
  if devices[0].platform == "cpu":
    return False  # faiss's BLAS scan is the faster one on a CPU
  limit = (devices[0].memory_stats() or {}).get("bytes_limit")
  return limit is None or num_bytes / len(devices) <= limit / 2


def _bucket(k: int) -> int:
  return max(MIN_K, 1 << (k - 1).bit_length())


class DeviceFlat:
  """Exact maximum-inner-product top-k over float16 vectors kept on this process's devices.

  `ids` ([N] int64, default 0..N-1) are the labels `search` returns for the vectors' rows (token
  ids of a subcorpus or of the tokens a filter keeps); -1 where fewer than k vectors exist.
  """

  def __init__(self, vectors: np.ndarray, ids: np.ndarray | None = None, *, mesh=None):
    if vectors.ndim != 2 or not len(vectors):
      raise ValueError(f"DeviceFlat needs [N > 0, D] vectors, got shape {vectors.shape}")
    self.mesh = mesh or make_mesh(local=True)
    self.ntotal, self.d = vectors.shape
    self.ids = (np.arange(self.ntotal, dtype=np.int64) if ids is None
                else np.asarray(ids, np.int64))
    if self.ids.shape != (self.ntotal,):
      raise ValueError(f"ids must be [{self.ntotal}], got shape {self.ids.shape}")
    devices = self.mesh.size
    per_device = -(-self.ntotal // devices)
    self.block = min(BLOCK_ROWS, max(MIN_K, 1 << (per_device - 1).bit_length()))
    rows = -(-per_device // self.block) * self.block * devices  # whole blocks on every device
    padded = np.zeros((rows, self.d), np.float16)
    padded[:self.ntotal] = vectors
    self.vectors = jax.device_put(padded, NamedSharding(self.mesh, P("data", None)))
    self.queries_sharding = NamedSharding(self.mesh, P())

  def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores [Q, k] float32, labels [Q, k] int64) of the top-k vectors of each query, best
    first, as faiss's `IndexFlatIP.search` returns them."""
    queries = np.ascontiguousarray(queries, np.float32)
    if queries.ndim != 2 or queries.shape[1] != self.d:
      raise ValueError(f"queries must be [Q, {self.d}], got shape {queries.shape}")
    if k < 1:
      raise ValueError(f"k must be >= 1, got {k}")
    fn = _top_k_fn(self.mesh, self.block, self.ntotal, _bucket(k))
    scores = np.empty((len(queries), k), np.float32)
    labels = np.empty((len(queries), k), np.int64)
    pending = None  # the previous chunk's device results: copied back while the next runs
    for lo in range(0, len(queries), QUERY_CHUNK):
      part = np.zeros((QUERY_CHUNK, self.d), np.float32)
      part[:len(queries[lo:lo + QUERY_CHUNK])] = queries[lo:lo + QUERY_CHUNK]
      result = fn(self.vectors, jax.device_put(part, self.queries_sharding))
      if pending is not None:
        self._store(pending, scores, labels, k)
      pending = (lo, result)
    if pending is not None:
      self._store(pending, scores, labels, k)
    return scores, labels

  def warm(self, max_k: int) -> int:
    """Compiles the search for every k up to `max_k` (one program per power of two), so that
    none compiles while serving; returns how many."""
    buckets = [MIN_K << i for i in range((_bucket(max_k) // MIN_K).bit_length())]
    for k in buckets:
      self.search(np.zeros((1, self.d), np.float32), k)
    return len(buckets)

  def _store(self, pending, scores: np.ndarray, labels: np.ndarray, k: int) -> None:
    lo, (top_scores, top_rows) = pending
    n = len(scores[lo:lo + QUERY_CHUNK])
    top_scores, top_rows = np.asarray(top_scores)[:n, :k], np.asarray(top_rows)[:n, :k]
    found = top_rows >= 0
    scores[lo:lo + n] = np.where(found, top_scores, -np.inf)
    labels[lo:lo + n] = np.where(found, self.ids[np.where(found, top_rows, 0)], -1)


@functools.lru_cache(maxsize=16)
def _top_k_fn(mesh, block: int, ntotal: int, k: int):
  """The jitted search of one chunk of queries: each device scans its rows block by block with
  a running top-k, then the devices' top-k are gathered and merged (rows >= ntotal are padding:
  score -inf, row -1)."""

  def local(vectors, queries):  # vectors [rows, D] of this device, queries [Qc, D]
    rows = vectors.shape[0]
    first = jax.lax.axis_index("data") * rows
    blocks = vectors.reshape(rows // block, block, -1)
    keep = min(k, block)

    def scan(carry, item):
      best_scores, best_rows = carry
      index, vecs = item
      scores = jnp.dot(queries, vecs.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)  # [Qc, block]
      row = first + index * block + jnp.arange(block)
      scores = jnp.where(row < ntotal, scores, -jnp.inf)
      block_scores, at = jax.lax.top_k(scores, keep)
      merged = jnp.concatenate([best_scores, block_scores], 1)
      merged_rows = jnp.concatenate([best_rows, jnp.where(jnp.isfinite(block_scores),
                                                          row[at], -1)], 1)
      top, pick = jax.lax.top_k(merged, k)
      return (top, jnp.take_along_axis(merged_rows, pick, 1)), None

    start = (jnp.full((queries.shape[0], k), -jnp.inf, jnp.float32),
             jnp.full((queries.shape[0], k), -1, jnp.int32))
    (scores, found), _ = jax.lax.scan(scan, start, (jnp.arange(len(blocks)), blocks))
    scores = jax.lax.all_gather(scores, "data", axis=1, tiled=True)  # [Qc, devices * k]
    found = jax.lax.all_gather(found, "data", axis=1, tiled=True)
    top, pick = jax.lax.top_k(scores, k)
    return top, jnp.take_along_axis(found, pick, 1)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data", None), P()),
                               out_specs=(P(), P()), check_vma=False))
