"""Data parallelism: one mesh axis `data` over all devices, batches sharded, params replicated.

The same code runs in one process or in many (`jax.distributed`, see `dpjax.distributed`): a
mesh spans all global devices, each process puts only its own rows of a batch on its devices
(`global_batch`), host values go onto global shardings with `global_array`, and results come
back to every process with `to_host`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def make_mesh(num_devices: int | None = None, *, local: bool = False) -> jax.sharding.Mesh:
  """A 1-D mesh with axis `data` over the first `num_devices` devices (default: all).

  `local=True` uses only this process's devices (for work each process does on its own, like
  encoding its share of a corpus).
  """
  devices = jax.local_devices() if local else jax.devices()
  n = num_devices or len(devices)
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,), devices=devices[:n])


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def round_to_devices(batch_size: int, mesh: jax.sharding.Mesh) -> int:
  """The smallest multiple of the mesh size that is >= batch_size."""
  return -(-batch_size // mesh.size) * mesh.size


def local_rows(sharding: jax.sharding.Sharding, num_rows: int) -> slice:
  """The rows of a `num_rows` batch that live on this process's devices under `sharding`."""
  spans = sorted({(i[0].start or 0, num_rows if i[0].stop is None else i[0].stop)
                  for i in sharding.addressable_devices_indices_map((num_rows,)).values()})
  for (_, stop), (start, _) in zip(spans, spans[1:]):
    if stop != start:
      raise ValueError(f"this process's rows {spans} are not contiguous under {sharding}")
  return slice(spans[0][0], spans[-1][1])


def global_batch(local: Any, sharding: jax.sharding.Sharding, num_rows: int,
                 num_local_rows: int | None = None) -> Any:
  """A global batch from this process's rows (`local_rows`) of every array in `local`.

  Arrays with several rows per example (e.g. h hard negatives each) scale accordingly: an array
  of r * num_local_rows local rows is r * num_rows rows globally.
  """
  num_local_rows = num_local_rows or len(jax.tree.leaves(local)[0])
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
      sharding, np.asarray(x), (len(x) * num_rows // num_local_rows, *np.shape(x)[1:])), local)


def global_array(tree: Any, shardings: Any) -> Any:
  """Host values (identical in every process) placed onto global shardings."""
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(put, tree, shardings)


def to_host(x: jax.Array) -> np.ndarray:
  """The whole value of a (possibly multi-process) array, in every process."""
  if x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


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
  mine = local_rows(sharding, batch_size)
  for start in range(0, total, batch_size):
    rows = slice(start, min(start + batch_size, total))
    n = rows.stop - rows.start
    batch = global_batch([pad_to_multiple(a[rows], batch_size)[mine] for a in arrays], sharding,
                         batch_size)
    outputs = fn(*batch)
    yield rows, jax.tree.map(lambda x: to_host(x)[:n], outputs)
