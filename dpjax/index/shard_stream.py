"""One shard written batch by batch as the encoder's outputs come (`ShardStream`)."""
from __future__ import annotations

import concurrent.futures
import functools
import io
import logging
import os
import pathlib

import numpy as np

from dpjax.data.squad import Passage
from dpjax.index.shards import seal_shard, write_error, write_shard_files
from dpjax.index.window_maker import forward_result, kept_slices
from dpjax.io import commit_directory, remove

log = logging.getLogger(__name__)


class ShardStream:
  """One shard written batch by batch, in `write_shard`'s layout and atomicity, by a writer
  thread: each window's kept runs go from the encoder's outputs straight to their rows in
  `vectors.npy` / `filter_logits.npy` of `<name>.tmp` (os.pwrite at their offsets). The thread
  that feeds the encoder neither copies the tokens into a shard-sized array nor waits at the end
  for a shard's worth of writing. `tables` writes the small arrays, the passages and the shard's
  info as soon as the last block of windows is made (while its tokens are encoded); `finish`
  writes the .npy headers (the number of rows, known then too: .npy headers are 128 bytes
  whatever the count) and, given a `sealer` thread, hands the shard to it, which records its
  files' checksums, syncs it and renames it into place while the writer goes on with the next
  shard's writes (both mostly outside the GIL: reading back, CRC-32, fsync, pwrite). A failed
  write is raised by the next call (a DumpError naming the shard). Streams that share `failed`
  (one list per dump) raise the dump's first failed write: a later shard's writes, queued behind
  it, report that one."""

  def __init__(self, directory: pathlib.Path, name: str, dim: int,
               writer: concurrent.futures.ThreadPoolExecutor, failed: list | None = None,
               sealer: concurrent.futures.ThreadPoolExecutor | None = None):
    self.final = directory / name
    self.failed = [] if failed is None else failed
    self.tmp = self.final.with_name(name + ".tmp")
    self.writer, self.sealer = writer, sealer
    self.sealing: concurrent.futures.Future | None = None  # the sealer's job, once handed over
    self.files: list[tuple[int, int, int]] = []  # (fd, data offset, columns)
    self.stored = 0
    self.error: BaseException | None = None
    self.pending: list[concurrent.futures.Future] = []
    self.entry: dict | None = None  # the shard's info, once `tables` wrote it
    self._submit(self._open, dim)

  def add(self, runs: dict, rows: np.ndarray, vectors: np.ndarray, logits: np.ndarray) -> None:
    """Writes the kept tokens (`runs`, `kept_runs`') of a batch of windows (`rows`; outputs
    [B, width, ...])."""
    self._submit(self._write_batch, runs, rows, vectors, logits)

  def tables(self, arrays: dict[str, np.ndarray], passages: list[Passage],
             windows: dict | None = None) -> None:
    """Writes `arrays` (token_passage, char_spans: one row per kept token), the passages and
    the shard's info (with `windows`' counts), before the last tokens' vectors come (`finish`
    then only completes)."""
    self._submit(self._tables, arrays, passages, windows)

  def finish(self, total: int) -> concurrent.futures.Future:
    """A future of the shard's manifest entry, once its `total` kept tokens and its tables
    (`tables`, sent before) are written and the shard is in place."""
    self._submit(self._finish, total)
    if self.sealer is None:
      return self.pending[-1]
    entry: concurrent.futures.Future = concurrent.futures.Future()

    def sealed(written: concurrent.futures.Future) -> None:  # (the seal's, or the write's error)
      if written.cancelled() or written.exception() is not None:
        forward_result(entry, written)
      else:
        written.result().add_done_callback(functools.partial(forward_result, entry))
    self.pending[-1].add_done_callback(sealed)
    return entry

  def close(self) -> None:
    """After an error elsewhere: waits for the writes submitted and the seal, closes the files
    and removes the unfinished shard."""
    concurrent.futures.wait(self.pending)
    if self.sealing is not None:
      concurrent.futures.wait([self.sealing])
    self._close_files()
    remove(self.tmp)

  def _submit(self, fn, *args) -> None:
    for done in [f for f in self.pending if f.done()]:  # a failed write stops the dump now
      self.pending.remove(done)
      done.result()
    self.pending.append(self.writer.submit(self._guarded, fn, *args))

  def _guarded(self, fn, *args):
    if self.error is None and self.failed:  # another shard's write failed first
      self.error = self.failed[0]
    if self.error is not None:  # writes queued behind a failed one do nothing
      self._close_files()  # (a shard written whole, its seal queued behind it: removed too)
      remove(self.tmp)
      raise self.error
    try:
      return fn(*args)
    except BaseException as e:  # nothing half-written left behind
      self._close_files()
      remove(self.tmp)
      self.error = write_error(self.final, e) if isinstance(e, OSError) else e
      self.failed.append(self.error)
      raise self.error from None

  def _open(self, dim: int) -> None:
    remove(self.tmp)
    self.tmp.mkdir(parents=True)
    for key, width in (("vectors", dim), ("filter_logits", 2)):
      fd = os.open(self.tmp / f"{key}.npy", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      self.files.append((fd, len(_npy_header(0, width)), width))

  def _write_batch(self, runs: dict, rows: np.ndarray, *outputs: np.ndarray) -> None:
    for b, column, length, destination in kept_slices(runs, rows, outputs[0].shape[1]):
      for (fd, offset, width), output in zip(self.files, outputs):
        data = np.ascontiguousarray(output[b, column:column + length], np.float16)
        _pwrite_all(fd, memoryview(data).cast("B"), offset + destination * width * 2)
      self.stored += length

  def _tables(self, arrays: dict[str, np.ndarray], passages: list[Passage],
              windows: dict | None) -> None:
    self.entry = write_shard_files(self.tmp, self.final.name, arrays, passages,
                                   len(arrays["token_passage"]), windows)

  def _finish(self, total: int):
    """The shard's files completed; then sealed here (`_seal`: the entry), or by the sealer (a
    future of it)."""
    if self.entry is None:
      raise AssertionError(f"{self.final.name}: finished before its tables were written")
    if self.stored != total or self.entry["tokens"] != total:  # every window comes back once
      raise AssertionError(f"{total - self.stored} of {total} kept tokens were not encoded "
                           f"({self.entry['tokens']} in the shard's tables)")
    for fd, offset, width in self.files:
      header = _npy_header(total, width)
      if len(header) != offset:  # numpy keeps room for any count in a 2-D header
        raise AssertionError(f"a .npy header of {len(header)} bytes, {offset} reserved")
      _pwrite_all(fd, memoryview(header), 0)
      os.ftruncate(fd, offset + total * width * 2)  # the size np.load expects (0 tokens too)
    self._close_files()
    if self.sealer is None:
      return self._seal(total)
    self.sealing = self.sealer.submit(self._guarded, self._seal, total)
    return self.sealing

  def _seal(self, total: int) -> dict:
    """Records the files' checksums, syncs the shard and renames it into place."""
    self.entry = seal_shard(self.tmp, self.entry)
    commit_directory(self.tmp, self.final)
    log.info("%s: %d passages, %d tokens", self.final.name, self.entry["passages"], total)
    return self.entry

  def _close_files(self) -> None:
    while self.files:
      os.close(self.files.pop()[0])


def _npy_header(rows: int, width: int) -> bytes:
  """The .npy (version 1.0) header of a [rows, width] float16 array."""
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      header, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float16)),
               "fortran_order": False, "shape": (rows, width)})
  return header.getvalue()


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
  while data:
    written = os.pwrite(fd, data, at)
    data, at = data[written:], at + written
