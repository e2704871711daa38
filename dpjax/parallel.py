"""Data parallelism: one mesh axis `data` over all devices, batches sharded, params replicated."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def make_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh with axis `data` over the first `num_devices` devices (default: all)."""
  n = num_devices or jax.device_count()
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def round_to_devices(batch_size: int, mesh: jax.sharding.Mesh) -> int:
  """The smallest multiple of the mesh size that is >= batch_size."""
  return -(-batch_size // mesh.size) * mesh.size


def pad_to_multiple(array: np.ndarray, multiple: int) -> np.ndarray:
  """Pads axis 0 with zeros to a multiple of `multiple`."""
  extra = -len(array) % multiple
  if not extra:
    return array
  return np.concatenate([array, np.zeros((extra, *array.shape[1:]), array.dtype)])


def map_batches(fn: Callable[..., Any], arrays: Sequence[np.ndarray], batch_size: int,
                mesh: jax.sharding.Mesh) -> Iterator[tuple[slice, Any]]:
  """Applies a jitted `fn(*batch)` to fixed-size batches of `arrays`, sharded over the mesh.

  The last batch is padded to `batch_size` (one compiled shape) and the padding rows are cut
  from the outputs before they are yielded, so no padding ever leaks.

  Yields:
    (rows, outputs): the slice of input rows and `fn`'s outputs for them, as numpy arrays.
  """
  if batch_size % mesh.size:
    raise ValueError(f"batch_size {batch_size} is not a multiple of the {mesh.size} devices")
  total = len(arrays[0])
  sharding = batch_sharding(mesh)
  for start in range(0, total, batch_size):
    rows = slice(start, min(start + batch_size, total))
    n = rows.stop - rows.start
    batch = [jax.device_put(pad_to_multiple(a[rows], batch_size), sharding) for a in arrays]
    outputs = jax.device_get(fn(*batch))
    yield rows, jax.tree.map(lambda x: np.asarray(x)[:n], outputs)
