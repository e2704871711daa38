"""Data parallelism: one mesh axis `data` over all devices, batches sharded, params replicated.

The same code runs in one process or in many (`jax.distributed`, see `dpjax.distributed`): a
mesh spans all global devices, each process puts only its own rows of a batch on its devices
(`global_batch`), host values go onto global shardings with `global_array`, and results come
back to every process with `to_host`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


_COMPILE = {"seconds": 0.0, "count": 0, "listening": False,
            "by_function": collections.defaultdict(lambda: [0, 0.0])}
_COMPILE_LOCK = threading.Lock()  # compiles may run in threads (`compile_ahead`)


def compile_stats() -> dict:
  """{"seconds", "count"}: JAX's tracing, lowering and XLA compilation so far in this process
  (from `jax.monitoring`; counted from the first call of this function)."""
  if not _COMPILE["listening"]:
    def listen(event: str, seconds: float, fun_name: str | None = None, **kwargs):
      if not event.startswith("/jax/core/compile/"):
        return
      with _COMPILE_LOCK:
        _COMPILE["seconds"] += seconds
        if event.endswith("backend_compile_duration"):
          _COMPILE["count"] += 1
          counts = _COMPILE["by_function"][str(fun_name)]
          counts[0], counts[1] = counts[0] + 1, counts[1] + seconds
    jax.monitoring.register_event_duration_secs_listener(listen)
    _COMPILE["listening"] = True
  return {"seconds": _COMPILE["seconds"], "count": _COMPILE["count"]}


def compiles_by_function() -> dict[str, tuple[int, float]]:
  """{function name (`jit(train_step)`...): (XLA compiles, their seconds)} so far, counted as
  `compile_stats` counts."""
  compile_stats()
  with _COMPILE_LOCK:
    return {name: tuple(counts) for name, counts in _COMPILE["by_function"].items()}


def call_widths(multiple: int, max_length: int) -> list[int]:
  """Every width `map_batches` cuts a call of rows at most `max_length` long to (their longest
  row rounded up to `multiple`, at most the arrays' own width)."""
  return sorted({min(k * multiple, max_length) for k in range(1, -(-max_length // multiple) + 1)})


def compile_at_once(compile_one: Callable[[Any], None], shapes: Sequence,
                    threads: int | None = None) -> int:
  """Runs `compile_one(shape)` for every shape at once in `threads` threads (default: the CPUs;
  XLA compiles outside the GIL): a long job's shapes compiled before its first call, sooner
  together than one after the other as the calls come. Returns the shapes compiled."""
  threads = max(1, min(len(shapes), threads or os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(compile_one, shapes))
  return len(shapes)


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
                mesh: jax.sharding.Mesh, *, lengths: np.ndarray | None = None,
                length_multiple: int = 32, in_flight: int = 2, pad_last: bool = False,
                timings: dict | None = None) -> Iterator[tuple[np.ndarray, Any]]:
  """Applies a jitted `fn(*batch)` to batches of `arrays`' rows, sharded over the mesh (on one
  device of one process the batch's numpy arrays, which jit places: `_placed`; shapes compiled
  ahead take `batch_spec` inputs).

  Batches hold `batch_size` rows; the last one is padded only to the smallest power-of-two
  multiple of the mesh size that holds it (one question is encoded as a batch of one, not 64),
  or, with `pad_last`, to `batch_size` (a long job: one compiled shape per width, not several);
  padding rows are cut from the outputs before they are yielded, so no padding ever leaks.

  With `lengths` (the real length of each row along axis 1, e.g. `attention_mask.sum(1)`), rows
  are taken longest first and every array with a sequence axis (axis 1) is cut, per batch, to
  the batch's longest row rounded up to `length_multiple`: no compute on padding tokens, a few
  compiled shapes. Outputs along that axis are then as wide as the batch's arrays.

  `in_flight` batches are dispatched before the oldest one's outputs are read (their host
  copies started at dispatch), so the device never waits for the host between batches. With
  `timings` (a dict), the calling thread's seconds are added up under "dispatch" (placing each
  batch and launching `fn`; on one device, jit's own placing of the numpy arrays), "wait"
  (blocked until a batch's outputs are computed: the device's work) and "fetch" (copying the
  computed outputs into numpy arrays): the rest of a caller's time is its own host work.

  Yields:
    (rows, outputs): the indices of the batch's input rows and `fn`'s outputs for them, as
    numpy arrays (rows in input order when `lengths` is None).
  """
  sharding = batch_sharding(mesh)
  numpy_inputs = _one_device(sharding)  # `_placed`
  pending: collections.deque = collections.deque()
  for rows, padded, width in _calls(len(arrays[0]), batch_size, mesh, lengths, length_multiple,
                                    pad_last):
    if width is None:
      batch = [a[rows] for a in arrays]
    else:  # the rows' columns up to the width only are copied
      batch = [a[rows, :width] if a.ndim > 1 else a[rows] for a in arrays]
    place = functools.partial(_placed, batch, sharding, padded, numpy_inputs)
    pending.append((rows, _dispatch(fn, place, timings)))
    if len(pending) >= max(in_flight, 1):
      yield _read(*pending.popleft(), timings)
  while pending:
    yield _read(*pending.popleft(), timings)


def _calls(total: int, batch_size: int, mesh: jax.sharding.Mesh, lengths: np.ndarray | None,
           length_multiple: int, pad_last: bool) -> Iterator[tuple[np.ndarray, int, int | None]]:
  """`map_batches`' calls over `total` rows: (the rows, the rows padded to, the width the arrays
  are cut to, None: uncut)."""
  if batch_size % mesh.size:
    raise ValueError(f"batch_size {batch_size} is not a multiple of the {mesh.size} devices")
  if lengths is None:
    order = np.arange(total)
  else:
    lengths = np.asarray(lengths)
    if lengths.shape != (total,):
      raise ValueError(f"lengths has shape {lengths.shape}, expected ({total},)")
    order = np.argsort(-lengths, kind="stable")
  for start in range(0, total, batch_size):
    rows = order[start:start + batch_size]
    padded = batch_size if pad_last else padded_rows(len(rows), batch_size, mesh)
    width = None if lengths is None else (
        -(-max(int(lengths[rows].max()), 1) // length_multiple) * length_multiple)
    yield rows, padded, width


def call_shapes(lengths: np.ndarray, array_width: int, batch_size: int,
                mesh: jax.sharding.Mesh, *, length_multiple: int = 32,
                pad_last: bool = False) -> list[tuple[int, int]]:
  """Every (rows, width) of the calls `map_batches` makes with these arguments over arrays
  `array_width` columns wide, in order: what to compile ahead for them."""
  return sorted({(padded, min(width, array_width)) for _, padded, width in _calls(
      len(lengths), batch_size, mesh, lengths, length_multiple, pad_last)})


def _placed(batch: list[np.ndarray], sharding: NamedSharding, padded: int,
            numpy_inputs: bool) -> list:
  """A batch's arrays padded to `padded` rows, as `fn`'s inputs: with `numpy_inputs`
  (`_one_device(sharding)`: one device of a single process) the numpy arrays themselves (jit
  places them on its parameters' device in its C++ dispatch, which costs the host thread less
  than a global array built per call: results/code_measurements.md), else global arrays of this
  process's rows (`global_batch`)."""
  batch = [pad_to_multiple(a, padded) for a in batch]
  if numpy_inputs:
    return batch
  mine = local_rows(sharding, padded)
  return global_batch([a[mine] for a in batch], sharding, padded)


def batch_spec(shape: tuple[int, ...], dtype, mesh: jax.sharding.Mesh) -> jax.ShapeDtypeStruct:
  """A `map_batches` call's input as its calls pass it (`_placed`), to compile them ahead: on one
  device numpy arrays (no sharding: a spec sharded on that device lowers another program, and
  the calls would compile again), else sharded over the mesh's batch axis."""
  sharding = batch_sharding(mesh)
  if _one_device(sharding):
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _one_device(sharding: NamedSharding) -> bool:
  """Whether `sharding` is the default device of the only process (where jit puts numpy
  inputs that no committed argument places elsewhere)."""
  return (sharding.num_devices == 1 and jax.process_count() == 1
          and next(iter(sharding.device_set)) == jax.local_devices()[0]
          and jax.config.jax_default_device is None)


def padded_rows(n: int, batch_size: int, mesh: jax.sharding.Mesh) -> int:
  """The rows `map_batches` pads a batch of `n` rows to: `batch_size`, or for a short last batch
  the smallest power-of-two multiple of the mesh size that holds it."""
  return min(batch_size, mesh.size * 2 ** int(np.ceil(np.log2(-(-n // mesh.size)))))


def _dispatch(fn: Callable[..., Any], place: Callable[[], list], timings: dict | None) -> Any:
  """`fn(*place())`, its outputs' host copies started (timed under "dispatch")."""
  begin = time.perf_counter()
  outputs = fn(*place())
  for x in jax.tree.leaves(outputs):
    if x.is_fully_addressable:
      x.copy_to_host_async()
  _add(timings, "dispatch", begin)
  return outputs


def _add(timings: dict | None, key: str, begin: float) -> None:
  if timings is not None:
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - begin


def _read(rows: np.ndarray, outputs: Any, timings: dict | None) -> tuple[np.ndarray, Any]:
  """(rows, outputs on the host, padding rows cut)."""
  begin = time.perf_counter()
  if timings is not None:
    jax.block_until_ready(outputs)
    _add(timings, "wait", begin)
    begin = time.perf_counter()
  outputs = jax.tree.map(lambda x: to_host(x)[:len(rows)], outputs)
  _add(timings, "fetch", begin)
  return rows, outputs
