"""Dumping the phrase vectors of a corpus to disk, in shards, resumably.

Every passage is cut into windows like the training data; each window is encoded by the jitted
phrase encoder, sharded over all devices (fixed batches, padding dropped); of every context token
only the copy from its "max context" window is kept, so token ids are contiguous within a
passage and each token is stored once. A shard holds, for `shard_passages` passages:

  vectors.npy        [T, D] float16  token vectors h_t
  filter_logits.npy  [T, 2] float16  start/end logits of the token-filter head
  token_passage.npy  [T]    int32    passage row (global) of each token
  char_spans.npy     [T, 2] int32    characters [start, end) of each token in its passage text
  passages.jsonl                     {"id", "title", "text"} of the shard's passages

  shard.json                         {"name", "passages", "tokens"}

Shards are written into `<name>.tmp` and renamed when complete; `manifest.json` says
`"complete": true` (and lists the shards) only when the whole corpus is done. Running the dump
again redoes only the missing shards; a dump that is not complete is refused by the indexer.
Several processes can dump together, each encoding its own shards (see `dump_phrases`). The
manifest carries a fingerprint of the phrase encoder, so that search can check that questions are
encoded by the model that produced the vectors, a hash of every shard's passages, so that a dump
is never resumed or reused with another corpus, and a dump id that its indexes record.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import functools
import io
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import time
from typing import ClassVar, Iterable, Iterator

import jax
import numpy as np
from flax import nnx

from dpjax import distributed
from dpjax.data.squad import (Passage, build_windows, windows_worker, windows_worker_ready,
                              windows_worker_setup)
from dpjax.data.tokenization import Tokenizer
from dpjax.errors import DumpError
from dpjax.io import (Progress, atomic_directory, checksum_problems, commit_directory, digest,
                      digest_texts, file_checksum, folder_checksums, read_json, remove,
                      write_json, write_jsonl)
from dpjax.models.encoders import bound, call_widths, compile_ahead, phrase_batches, phrase_calls
from dpjax.models.densephrases import compute_dtype, with_compute_dtype
from dpjax.parallel import compile_stats

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
SHARD_INFO = "shard.json"
# Shard 0's windows are made in blocks of 64, 128, 256, ... passages (`WindowMaker.submit_blocks`):
# the encoder waits for 64 passages to be tokenized, not a shard's worth, at the start of a dump,
# and the blocks' calls encode about the whole shard's tokens (`encode_shard`). On a CPU the
# tokenizer's thread then runs beside the encoder's threads on the same cores, yet dumps were as
# fast in blocks as whole, with less host time in the main thread (results/code_measurements.md).
FIRST_BLOCK = 64


# On an accelerator a dump of a full shard or more compiles the phrase encoder for every call width
# before its first call, all widths at once (`compile_ahead`), sooner than as they come although
# the compiles contend (results/speed_gpu.md). A smaller corpus, whose windows may need few of
# the widths, and a CPU (short compiles; its cores are the tokenizer's and the encoder's)
# compile the widths as they come.
def _compile_ahead(mesh) -> bool:
  return mesh.devices.flat[0].platform != "cpu"


def params_fingerprint(module) -> str:
  """A short hash of a module's parameters."""
  return digest(*(np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(module, nnx.Param))))


def encoder_fingerprint(model) -> str:
  """A short hash of the phrase encoder's parameters (identifies the model of a dump)."""
  return params_fingerprint(model.phrase_encoder)


@dataclasses.dataclass
class DumpConfig:
  max_seq_length: int = 384
  doc_stride: int = 128
  include_title: bool = True
  batch_size: int = 64
  shard_passages: int = 2000
  # > 0: windows spaced as widely as keeps this much context around every token (fewer tokens
  # encoded twice; `build_windows`), instead of every doc_stride tokens as in training.
  min_context: int = 0
  # The encoder's compute dtype for the dump ("float32", "bfloat16"; None: the model's own). The
  # manifest records the one used, so a dump is never resumed or indexed across dtypes.
  compute_dtype: str | None = None
  # Call widths are the calls' longest window rounded up to this (0: the platform's, 32 on an
  # accelerator, 16 on a CPU: `phrase_calls`); each width compiles once. Speed only: the vectors
  # differ by rounding at most, so a dump resumes at another multiple (the manifest's
  # `width_multiple` is that of the run that made it or finished it).
  width_multiple: int = 0


def _batches(iterable: Iterable, size: int) -> Iterator[list]:
  iterator = iter(iterable)
  while chunk := list(itertools.islice(iterator, size)):
    yield chunk


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
  write_json(directory / MANIFEST, manifest)


def read_manifest(directory: str | os.PathLike, *, rewriting_filter: bool = False) -> dict:
  """The manifest of a complete dump (DumpError when missing or incomplete; `rewriting_filter`:
  also one whose filter logits' rewrite was interrupted, for the rewrite that starts again)."""
  directory = pathlib.Path(directory)
  if not (directory / MANIFEST).is_file():
    raise DumpError(f"{directory}: no {MANIFEST}: not a phrase dump (run `run.py dump`)")
  try:
    manifest = json.loads((directory / MANIFEST).read_text())
  except (OSError, ValueError) as e:
    raise DumpError(f"{directory / MANIFEST}: unreadable ({type(e).__name__}: {e}); delete the "
                    "dump and run it again") from None
  if not manifest.get("complete"):
    raise DumpError(f"{directory}: the dump is incomplete (a run was interrupted); run the "
                    "same dump command again to finish it")
  if manifest.get("filter_rewrite_incomplete") and not rewriting_filter:
    raise DumpError(f"{directory}: rewriting its filter logits was interrupted; run "
                    "`run.py filter` again")
  return manifest


def write_shard(directory: pathlib.Path, name: str, arrays: dict[str, np.ndarray],
                passages: list[Passage]) -> dict:
  """Writes one shard atomically (temporary directory, then rename); returns its manifest entry.
  An unfinished shard of an older layout in its place is replaced."""
  try:
    with atomic_directory(directory / name) as tmp:
      return _seal(tmp, _write_shard_files(tmp, name, arrays, passages, len(arrays["vectors"])))
  except OSError as e:  # disk full, read-only, quota: name the place and the cause
    raise _write_error(directory / name, e) from None


def _write_shard_files(tmp: pathlib.Path, name: str, arrays: dict[str, np.ndarray],
                       passages: list[Passage], tokens: int, windows: dict | None = None) -> dict:
  """Writes `arrays`, the passages and the shard's info into `tmp`; returns the info.
  `windows`: the count of the windows encoded and of their real tokens (`encode_shard`)."""
  entry = {"name": name, "passages": len(passages), "tokens": int(tokens),
           "passages_sha": passages_digest(passages), **(windows or {})}
  for key, value in arrays.items():
    np.save(tmp / f"{key}.npy", value)
  write_jsonl(tmp / "passages.jsonl", map(dataclasses.asdict, passages))
  write_json(tmp / SHARD_INFO, entry, indent=None)
  return entry


def _seal(shard: pathlib.Path, entry: dict) -> dict:
  """The shard's info with the size and digest of each of its files (`file_checksum`), written
  last: loads check the sizes by it, `run.py verify` and serve/eval the contents."""
  entry = {**entry, "files": folder_checksums(shard, skip=[SHARD_INFO])}
  write_json(shard / SHARD_INFO, entry, indent=None)
  return entry


def record_rewrite(shard: pathlib.Path, entry: dict, name: str) -> None:
  """Records in `entry` (a manifest's) and the shard's info the new size and digest of its file
  `name`, rewritten in place (`run.py filter`'s logits); a shard without digests is left so."""
  if "files" in entry:
    entry["files"][name] = file_checksum(shard / name)
    write_json(shard / SHARD_INFO, entry, indent=None)


def shard_rerun(shard: pathlib.Path) -> str:
  """What remakes a damaged shard of a dump (and the indexes built from it)."""
  return (f"delete {shard} and {shard.parent / MANIFEST}, then run `run.py dump` (it encodes "
          "that shard again) and `run.py index`")


def shard_problems(shard: pathlib.Path, entry: dict, *, contents: bool,
                   names: Iterable[str] | None = None) -> list[str]:
  """What is wrong with a shard's files (`names`: those only) against the sizes and digests
  its info (`entry`) recorded (`checksum_problems`); none recorded (an older dump): none."""
  files = entry.get("files", {})
  return checksum_problems(shard, {n: files[n] for n in (files if names is None else names)
                                   if n in files}, contents=contents)


def check_shards(directory: pathlib.Path, manifest: dict, *, contents: bool = False) -> None:
  """Refuses a dump whose shard files are missing, of other sizes or (`contents`) of other
  bytes than when written: one DumpError naming the first such file and what to rerun. A dump
  from before digests were recorded is used, with a warning that it is unverified."""
  for shard in manifest["shards"]:
    problems = shard_problems(directory / shard["name"], shard, contents=contents)
    if problems:
      raise DumpError(f"{problems[0]}: the dump is damaged; "
                      f"{shard_rerun(directory / shard['name'])}")
  if any("files" not in shard for shard in manifest["shards"]):
    log.warning("%s: a dump made before digests were recorded: its shards are unverified",
                directory)


def _write_error(shard: pathlib.Path, e: OSError) -> DumpError:
  """The cause as the OS names it (errno's meaning); freeing space is advised only when space
  is what ran out (a file removed under the dump, by another run, is not a full disk)."""
  cause = os.strerror(e.errno) if e.errno else str(e)
  where = f" ({e.filename})" if e.filename and str(e.filename) != str(shard) else ""
  advice = ("free space and run the dump again (it resumes)"
            if e.errno in (errno.ENOSPC, errno.EDQUOT) else "run the dump again (it resumes)")
  return DumpError(f"{shard}: could not write the shard: {cause} (errno {e.errno}){where}; "
                   f"{advice}")


class ShardStream:
  """One shard written batch by batch, in `write_shard`'s layout and atomicity, by a writer
  thread: each window's kept runs go from the encoder's outputs straight to their rows in
  `vectors.npy` / `filter_logits.npy` of `<name>.tmp` (os.pwrite at their offsets). The thread
  that feeds the encoder neither copies the tokens into a shard-sized array nor waits at the end
  for a shard's worth of writing. `tables` writes the small arrays, the passages and the shard's
  info as soon as the last block of windows is made (while its tokens are encoded); `finish`
  writes the .npy headers (the number of rows, known then too: .npy headers are 128 bytes
  whatever the count) and renames the directory into place. A failed write is raised by the next
  call (a DumpError naming the shard). Streams that share `failed` (one list per dump) raise the
  dump's first failed write: a later shard's writes, queued behind it, report that one."""

  def __init__(self, directory: pathlib.Path, name: str, dim: int,
               writer: concurrent.futures.ThreadPoolExecutor, failed: list | None = None):
    self.final = directory / name
    self.failed = [] if failed is None else failed
    self.tmp = self.final.with_name(name + ".tmp")
    self.writer = writer
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

  def finish(self, total: int):
    """A future of the shard's manifest entry, once its `total` kept tokens and its tables
    (`tables`, sent before) are written and the shard is in place."""
    self._submit(self._finish, total)
    return self.pending[-1]

  def close(self) -> None:
    """After an error elsewhere: waits for the writes submitted, closes the files and removes
    the unfinished shard."""
    concurrent.futures.wait(self.pending)
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
      raise self.error
    try:
      return fn(*args)
    except BaseException as e:  # nothing half-written left behind
      self._close_files()
      remove(self.tmp)
      self.error = _write_error(self.final, e) if isinstance(e, OSError) else e
      self.failed.append(self.error)
      raise self.error from None

  def _open(self, dim: int) -> None:
    remove(self.tmp)
    self.tmp.mkdir(parents=True)
    for key, width in (("vectors", dim), ("filter_logits", 2)):
      fd = os.open(self.tmp / f"{key}.npy", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      self.files.append((fd, len(_npy_header(0, width)), width))

  def _write_batch(self, runs: dict, rows: np.ndarray, *outputs: np.ndarray) -> None:
    for b, column, length, destination in _kept_slices(runs, rows, outputs[0].shape[1]):
      for (fd, offset, width), output in zip(self.files, outputs):
        data = np.ascontiguousarray(output[b, column:column + length], np.float16)
        _pwrite_all(fd, memoryview(data).cast("B"), offset + destination * width * 2)
      self.stored += length

  def _tables(self, arrays: dict[str, np.ndarray], passages: list[Passage],
              windows: dict | None) -> None:
    self.entry = _write_shard_files(self.tmp, self.final.name, arrays, passages,
                                    len(arrays["token_passage"]), windows)

  def _finish(self, total: int) -> dict:
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
    self.entry = _seal(self.tmp, self.entry)
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


def window_settings(config: DumpConfig) -> dict:
  return {"max_seq_length": config.max_seq_length, "doc_stride": config.doc_stride,
          "include_title": config.include_title, "min_context": config.min_context}


def shard_windows(tokenizer: Tokenizer, passages: list[Passage], config: DumpConfig):
  """The windows a shard's passages are encoded in (tokenization: host work)."""
  return build_windows(tokenizer, passages, **window_settings(config))[0]


class WindowMaker:
  """Makes shards' windows (`shard_windows`) ahead of the encoder: in one thread, or in
  `workers` spawned processes. Tokenizing holds the GIL for much of its time (the tokenizer's
  outputs, packing the windows), which stalls the thread that feeds the encoder, and one thread
  tokenizes slower than an accelerator encodes: an accelerator's dump needs processes. A process
  takes a second or two to start (it imports the tokenizer and the SQuAD module, not JAX), so
  small dumps (and shard 0, made while the parameters are hashed) use the thread.

  Only a thread of its own (`handing`) creates the process pool and hands it jobs (`submit`
  returns at once): starting a process blocks the thread that starts it until the child has
  imported the program's main module and read its setup. When the first `workers` shards'
  `submit` started them from the thread that feeds the encoder, that thread waited once per
  worker (results/code_measurements.md)."""

  def __init__(self, tokenizer: Tokenizer, config: DumpConfig, workers: int = 0):
    self.tokenizer, self.config, self.workers = tokenizer, config, workers
    self.thread = concurrent.futures.ThreadPoolExecutor(1)
    self.handing = concurrent.futures.ThreadPoolExecutor(1)  # the one thread that submits
    self.processes = None
    self.ready: list[concurrent.futures.Future] = []  # `start`'s first tasks: the workers' pids

  def start(self) -> None:
    """Starts the worker processes now, in the background (a dump: while the encoder
    compiles), so that the shards submitted next find them started."""
    if self.workers:
      self.handing.submit(self._start_all)

  def _start_all(self) -> None:
    """(In the handing thread, which alone touches the pool.) The pool, if none yet, with every
    worker started: no first task returns before the last is submitted, so each starts one."""
    if self.processes is not None:
      return
    started = multiprocessing.get_context("spawn").Event()
    self.processes = self._pool(started)
    try:
      for _ in range(self.workers):
        self.ready.append(self.processes.submit(windows_worker_ready))
    finally:
      started.set()

  def _pool(self, started) -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(
        self.workers, mp_context=multiprocessing.get_context("spawn"),
        initializer=windows_worker_setup,
        initargs=(self.tokenizer, window_settings(self.config), started))

  def submit_blocks(self, passages: list[Passage]) -> list[tuple[int, object]]:
    """(passages, future of their windows) of consecutive blocks of `passages` (the first
    FIRST_BLOCK passages, each next block twice as many), made in turn by the thread: the
    encoder starts on the first block while the next ones are made (`encode_shard`)."""
    blocks, start, size = [], 0, FIRST_BLOCK
    while start < len(passages):
      block = passages[start:start + size]
      blocks.append((len(block), self.submit(block, thread=True)))
      start, size = start + size, 2 * size
    return blocks

  def submit(self, passages: list[Passage], *, thread: bool = False):
    """A future of the windows of `passages` (a process that cannot start: a DumpError)."""
    if thread or not self.workers:
      return self.thread.submit(shard_windows, self.tokenizer, passages, self.config)
    windows: concurrent.futures.Future = concurrent.futures.Future()

    def hand_over():
      try:
        self._start_all()
        job = self.processes.submit(windows_worker, passages)
      except Exception as e:  # e.g. a process that could not start
        windows.set_exception(DumpError(
            f"the dump's {self.workers} tokenizing processes did not start or died "
            f"({type(e).__name__}: {e}); try index.dump_workers=0 (one thread)"))
        return
      job.add_done_callback(functools.partial(_forward, windows))

    self.handing.submit(hand_over)
    return windows

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.handing.shutdown(wait=True)
    for pool in (self.thread, self.processes):
      if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _forward(to: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
  """`to` gets the result (or exception) of the finished `done`."""
  if done.cancelled():
    to.cancel()
  elif done.exception() is not None:
    to.set_exception(done.exception())
  else:
    to.set_result(done.result())


def kept_runs(keep: np.ndarray) -> dict[str, np.ndarray]:
  """The kept tokens of windows `keep` [W, L] as runs of consecutive columns, in passage order
  (window, then column): run r is `length[r]` tokens from column `column[r]` of window
  `window[r]`, stored from row `destination[r]` of the shard; `first[w]:first[w + 1]` are the
  runs of window w. (With the max-context rule a window keeps one run.)"""
  edges = np.diff(np.pad(keep, ((0, 0), (1, 1))).astype(np.int8), axis=1)  # [W, L + 1]
  window, column = np.nonzero(edges == 1)
  length = np.nonzero(edges == -1)[1] - column
  destination = np.cumsum(length) - length
  first = np.searchsorted(window, np.arange(len(keep) + 1))
  return {"window": window, "column": column, "length": length, "destination": destination,
          "first": first}


def encode_shard(tokenizer: Tokenizer, passages: list[Passage], config: DumpConfig,
                 mesh, encode, progress: Progress | None = None,
                 windows=None, timings: dict | None = None, stream=None,
                 pipeline: list | None = None) -> dict[str, np.ndarray]:
  """Encodes passages; returns the shard arrays (token rows in passage order, local passage
  rows). `windows`: the passages' `shard_windows` made ahead, or blocks of them, a list of
  (passages, windows or a future of them) over consecutive passages, encoded in turn (the
  encoder starts on the first block while the next ones are made; `pipeline` receives the
  seconds spent waiting for a block). Of each block's windows only those that fill calls of one
  width are encoded with it, the others with the next block's: until the shard's last calls no
  call holds padding rows or is wider than its windows need, so the blocks encode about the
  tokens of the whole shard at once (96,768 either way for the first 600 SQuAD dev passages in
  blocks of 64, 128, 256 and 152). `progress` counts the stored tokens batch by batch; `timings`
  (a dict) adds up `map_batches`' dispatch, wait and fetch seconds. `stream()`: a
  `ShardStream`; the vectors and filter logits then go to it batch by batch, and only
  token_passage and char_spans are returned (its shard info counts the windows and their real
  tokens: `windows`, `encoded_tokens`)."""
  if windows is None:
    windows = shard_windows(tokenizer, passages, config)
  blocks = windows if isinstance(windows, list) else [(len(passages), windows)]
  sink = stream() if stream else None
  out: dict[str, np.ndarray] = {}  # in memory (no sink): the vectors and logits, grown by block
  parts: dict[str, list[np.ndarray]] = collections.defaultdict(list)
  calls = phrase_calls(config.batch_size, mesh, config.width_multiple)  # (rows, width multiple)
  held = None  # windows carried into the next block's calls
  total = first_passage = stored = 0
  encoded = {"windows": 0, "encoded_tokens": 0}  # the windows' real tokens, re-encoded ones too
  for number, (count, block) in enumerate(blocks):
    if isinstance(block, concurrent.futures.Future):
      block = _timed_result(block, pipeline)
    encoded["windows"] += len(block.input_ids)
    encoded["encoded_tokens"] += int(block.attention_mask.sum())
    keep = block.context_mask & block.is_max_context  # [W, L]
    runs = kept_runs(keep)
    runs["destination"] = runs["destination"] + total  # shard rows
    todo = _Windows(block.input_ids, block.attention_mask,
                    {name: runs[name].tolist() for name in _Windows.RUNS}, keep.sum(1))
    if held is not None:
      todo = held.concat(todo)
    token_window = np.nonzero(keep)[0]
    parts["token_passage"].append(block.passage_index[token_window].astype(np.int32)
                                  + first_passage)
    parts["char_spans"].append(np.stack([block.char_start[keep], block.char_end[keep]], 1))
    total += len(token_window)
    first_passage += count
    if number + 1 < len(blocks):  # windows that would share a call with wider ones wait
      todo, held = todo.split(*calls)
    else:  # the shard's tables are complete: written while its last tokens are encoded
      tables = {key: np.concatenate(value) for key, value in parts.items()}
      if sink:
        sink.tables(tables, passages, encoded)
    stored += _encode_windows(todo, total, config, mesh, encode, progress, timings, sink, out)
  if stored != total:  # every window comes back once
    raise AssertionError(f"{total - stored} of {total} kept tokens were not encoded")
  return {**tables, **out}


def _timed_result(future: concurrent.futures.Future, seconds: list | None):
  """`future.result()`; the seconds spent waiting for it appended to `seconds` (if a list)."""
  begin = time.perf_counter()
  try:
    return future.result()
  finally:
    if seconds is not None:
      seconds.append(time.perf_counter() - begin)


@dataclasses.dataclass
class _Windows:
  """Windows to encode ([W, L] ids and mask) with their kept runs (`kept_runs`' lists, the
  destinations shard rows) and kept tokens [W]."""
  RUNS: ClassVar[tuple[str, ...]] = ("first", "column", "length", "destination")
  input_ids: np.ndarray
  attention_mask: np.ndarray
  runs: dict[str, list]
  kept: np.ndarray

  def take(self, rows: np.ndarray) -> "_Windows":
    runs = {name: [] for name in self.RUNS}
    runs["first"].append(0)
    for window in rows:
      a, b = self.runs["first"][window], self.runs["first"][window + 1]
      for name in self.RUNS[1:]:  # a run's fields
        runs[name] += self.runs[name][a:b]
      runs["first"].append(len(runs["column"]))
    return _Windows(self.input_ids[rows], self.attention_mask[rows], runs, self.kept[rows])

  def concat(self, other: "_Windows") -> "_Windows":
    runs = {name: self.runs[name] + other.runs[name] for name in self.RUNS[1:]}
    runs["first"] = self.runs["first"] + [f + len(self.runs["column"])
                                          for f in other.runs["first"][1:]]
    return _Windows(np.concatenate([self.input_ids, other.input_ids]),
                    np.concatenate([self.attention_mask, other.attention_mask]), runs,
                    np.concatenate([self.kept, other.kept]))

  def split(self, rows_per_call: int, width_multiple: int) -> tuple["_Windows", "_Windows"]:
    """(windows that fill calls of `rows_per_call` of one width, the rest): of the windows of
    each width (their length rounded up to `width_multiple`, as `phrase_batches` cuts a call),
    the longest multiple of `rows_per_call`; `phrase_batches` of the first makes only full
    calls, none wider than its windows need."""
    lengths = self.attention_mask.sum(1)
    order = np.argsort(-lengths, kind="stable")  # as map_batches takes them
    width = -(-lengths[order] // width_multiple)
    full = np.zeros(len(order), bool)
    for w in np.unique(width):
      same = np.flatnonzero(width == w)
      full[same[:len(same) // rows_per_call * rows_per_call]] = True
    return self.take(order[full]), self.take(order[~full])


def _encode_windows(windows: _Windows, total: int, config: DumpConfig, mesh, encode,
                    progress: Progress | None, timings: dict | None, sink,
                    out: dict[str, np.ndarray]) -> int:
  """Encodes windows; their kept tokens go to `sink`, or to `out`'s arrays (grown to the
  shard's `total` kept tokens so far). Returns the tokens stored."""
  # Batches of similar length (no compute on padding) come back out of order: each window's
  # runs of kept tokens are copied straight to their rows in passage order (slices, no gather).
  stored = 0
  for rows, (vectors, logits) in phrase_batches(encode, windows.input_ids,
                                                windows.attention_mask,
                                                batch_size=config.batch_size, mesh=mesh,
                                                width_multiple=config.width_multiple,
                                                timings=timings, pad_last=True):
    if sink:
      sink.add(windows.runs, rows, vectors, logits)
      count = int(windows.kept[rows].sum())
    else:
      for key, x in (("vectors", vectors), ("filter_logits", logits)):  # float16: [T, D], [T, 2]
        have = out.get(key, np.empty((0, x.shape[2]), np.float16))
        if key not in out or len(have) < total:  # (a shard of empty passages: [0, D])
          out[key] = np.concatenate([have, np.empty((total - len(have), x.shape[2]), have.dtype)])
      count = _place(windows.runs, rows, vectors.shape[1], (vectors, out["vectors"]),
                     (logits, out["filter_logits"]))
    stored += count
    if progress:
      progress.update(count)
  return stored


def _kept_slices(runs: dict, rows: np.ndarray,
                 width: int) -> Iterator[tuple[int, int, int, int]]:
  """(b, column, length, destination): each kept run of a batch's windows (`rows`, outputs
  `width` wide) as columns [column, column + length) of batch row b, stored from shard row
  `destination`."""
  for b, window in enumerate(rows):
    for r in range(runs["first"][window], runs["first"][window + 1]):
      column, length = runs["column"][r], runs["length"][r]
      if column + length > width:
        raise AssertionError(f"window {window}: kept tokens lie in padding (width {width})")
      yield b, column, length, runs["destination"][r]


def _place(runs: dict, rows: np.ndarray, width: int, *pairs) -> int:
  """Copies the kept runs of a batch's windows (`rows`, outputs `width` wide) from each
  (batch output [B, width, ...], shard array) pair; returns the tokens copied."""
  count = 0
  for b, column, length, destination in _kept_slices(runs, rows, width):
    for batch_output, shard in pairs:
      shard[destination:destination + length] = batch_output[b, column:column + length]
    count += length
  return count


def dump_phrases(model, tokenizer: Tokenizer, passages: Iterable[Passage],
                 out_dir: str | os.PathLike, config: DumpConfig, *, mesh,
                 model_info: dict | None = None, corpus_info: dict | None = None,
                 filter_head: dict | None = None, workers: int = 0) -> dict:
  """Writes (or resumes) the dump of `passages` into `out_dir`; returns the manifest.

  With several processes (`dpjax.distributed`) every process runs this with the same corpus:
  shard n is encoded by process n mod P on its own devices (`mesh` should be the process's local
  mesh), and process 0 writes the manifest once all shards exist. A shard is done when its
  directory exists (it is renamed into place complete), so a rerun resumes with the missing ones.
  Every shard records a hash of its passages (ids, titles, texts): a dump, finished or not, is
  refused for a corpus that is not the one it holds (`corpus_info`, e.g. the files, is recorded).
  `workers` processes tokenize the shards ahead of the encoder (0: one thread; `WindowMaker`).
  `filter_head`: what identifies a separately trained filter head put into `model` (None: its
  own); it and the tokenizer are recorded, and a dump of another one is not resumed or redone.
  """
  model, config = _checked_settings(model, config, mesh)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  chunks = _batches(passages, config.shard_passages)
  head = list(itertools.islice(chunks, 1))
  chunks = itertools.chain(head, chunks)
  with WindowMaker(tokenizer, config, workers) as maker:
    # Shard 0's windows are made while the encoder's parameters are hashed: a fresh dump's
    # first job, whose tokenizing nothing else would overlap (unused when shard 0 is done); in
    # blocks, so that encoding starts after 64 passages, not the whole shard.
    made = {0: maker.submit_blocks(head[0])} if head and distributed.process_share(0) else {}
    manifest = _new_manifest(model, tokenizer, config, model_info, corpus_info, filter_head)
    encode = bound(model, "phrases_and_filter")
    old = _existing(out_dir, manifest)
    if old is not None and old["complete"]:
      _check_corpus(out_dir, old["shards"], chunks)
      log.info("%s: dump already complete (%d passages, %d tokens)", out_dir,
               old["num_passages"], old["num_tokens"])
      return old
    _prepare(out_dir, manifest)
    start, compiled, cpu_start = time.perf_counter(), compile_stats(), time.thread_time()
    counts = {"shards": 0, "resumed": 0}
    todo = _shards_to_encode(out_dir, chunks, counts)
    full_shard = bool(head) and len(head[0]) == config.shard_passages
    if full_shard and maker.workers:  # more shards may follow: tokenized while it compiles
      todo = _first_shards_ahead(maker, todo, made)
    # while shard 0's first windows are made; a corpus of one shard at most compiles as it goes
    ahead, ahead_compile = _widths_ahead(encode, config, mesh, full_shard=full_shard)
    timings: dict[str, float] = {}  # map_batches': dispatching, waiting for the encoder, fetching
    pipeline: list[float] = []  # seconds waiting for the tokenizer's and writer's threads
    progress = Progress("dump", unit="tokens", logger=log)  # stored tokens, and tokens/s
    _encode_pipelined(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker,
                      made, pipeline, model.config.hidden_size)
  progress.close()
  if counts["resumed"]:
    log.info("%s: %d shards were already done (resumed)", out_dir, counts["resumed"])
  if not counts["shards"]:
    raise DumpError(f"{out_dir}: the corpus is empty")
  manifest.update(_host_times(start, cpu_start, compiled, timings, pipeline, ahead, ahead_compile))
  return _finish(out_dir, manifest, counts["shards"], time.perf_counter() - start)


def _new_manifest(model, tokenizer: Tokenizer, config: DumpConfig, model_info: dict | None,
                  corpus_info: dict | None, filter_head: dict | None) -> dict:
  """An incomplete dump's manifest: what identifies its vectors (`_existing` compares them)."""
  # The width multiple is speed only (the vectors differ by rounding at most): recorded, but
  # not a setting a dump is refused or resumed by.
  settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "width_multiple"}
  return {"complete": False, "fingerprint": encoder_fingerprint(model),
          "model": model_info or {}, "settings": settings,
          "tokenizer": tokenizer.fingerprint, "filter_head": filter_head,
          "width_multiple": config.width_multiple, "corpus": corpus_info or {},
          "dim": model.config.hidden_size, "shards": []}


def _first_shards_ahead(maker: WindowMaker, todo: Iterator, made: dict) -> Iterator:
  """Starts the workers and hands them the first `workers` shards after shard 0 (and shard 0
  unless `made` has it) now, so that they are tokenized while the encoder compiles; returns
  the shards to encode, these first. (Handed over as the encoder took them, the first shards
  after shard 0 were begun after the compiles, and the encoder then waited for them.)"""
  maker.start()
  first = list(itertools.islice(todo, maker.workers + 1))
  made.update({number: maker.submit(chunk) for number, chunk in first if number not in made})
  return itertools.chain(first, todo)


def _widths_ahead(encode, config: DumpConfig, mesh, full_shard: bool) -> tuple[dict, float]:
  """Compiles the encoder for every call width now (`compile_ahead`) on an accelerator when the
  corpus fills a shard; (the manifest's record of it, its compile time summed over threads)."""
  ahead = {"compile_ahead_seconds": 0.0, "compile_ahead_shapes": 0}
  if not (_compile_ahead(mesh) and full_shard):
    return ahead, 0.0
  start, compiled = time.perf_counter(), compile_stats()["seconds"]
  rows, multiple = phrase_calls(config.batch_size, mesh, config.width_multiple)
  ahead["compile_ahead_shapes"] = compile_ahead(encode, rows,
                                                call_widths(multiple, config.max_seq_length), mesh)
  ahead["compile_ahead_seconds"] = time.perf_counter() - start
  log.info("dump: the phrase encoder compiled (or loaded from the compilation cache) for %d "
           "widths in %.1f s", ahead["compile_ahead_shapes"], ahead["compile_ahead_seconds"])
  return ahead, compile_stats()["seconds"] - compiled


def _host_times(start: float, cpu_start: float, compiled: dict, timings: dict,
                pipeline: list, ahead: dict, ahead_compile: float) -> dict:
  """The manifest's timings of a dump begun at `start` (perf_counter; `cpu_start`: this thread's
  thread_time; `compiled`: compile_stats then; `ahead`: `_widths_ahead`'s record, included,
  `ahead_compile` its compile time).

  `host_seconds`: the main thread's time outside waiting for the encoder and compiling (once per
  window width, `compile_seconds`): the host work per token that caps a dump. On a CPU the
  encoder's threads share the cores with it, so its CPU time (`host_cpu_seconds`) is the work
  itself and the wall time adds the waits for a core. The compiling runs in this thread: its
  wall time is taken off, exact when nothing compiles (a warm dump), else an underestimate (at
  least 0). Widths compiled ahead (`compile_ahead`) compile in other threads at once, their
  compile times summed in `compile_seconds`: their wall time (`compile_ahead_seconds`) is taken
  off instead. `pipeline_wait_seconds`, a part of it: waits for the other threads' work (a
  shard's windows not yet tokenized, shard writes at the end): the pipeline's fill and drain,
  which a dump of many shards spreads thin and a one-shard dump does not. Two more parts of it,
  the encoder calls' host side (`map_batches`' timings): `dispatch_seconds`, placing the batches
  and launching the encoder (compiles taken off, as above), and `fetch_seconds`, copying its
  computed outputs into numpy arrays (from an accelerator: the device-to-host copies' tail)."""
  compile_seconds = compile_stats()["seconds"] - compiled["seconds"]
  in_this_thread = compile_seconds - ahead_compile
  waited = timings.get("wait", 0.0)
  return dict(encoder_wait_seconds=waited, compile_seconds=compile_seconds,
              compiles=compile_stats()["count"] - compiled["count"], **ahead,
              pipeline_wait_seconds=sum(pipeline),
              dispatch_seconds=max(timings.get("dispatch", 0.0) - in_this_thread, 0.0),
              fetch_seconds=timings.get("fetch", 0.0),
              host_seconds=(time.perf_counter() - start - waited - in_this_thread
                            - ahead["compile_ahead_seconds"]),
              host_cpu_seconds=max(time.thread_time() - cpu_start - in_this_thread, 0.0))


def _checked_settings(model, config: DumpConfig, mesh) -> tuple[object, DumpConfig]:
  """Refuses sizes below 1 and windows longer than the model's positions; returns the model
  computing in the dump's dtype (its own when none is set) and the settings naming that dtype
  (recorded in the manifest) and the width multiple the calls on `mesh` round to
  (`phrase_calls`: the platform's when none is set)."""
  if config.shard_passages < 1 or config.batch_size < 1:
    raise DumpError(f"shard_passages ({config.shard_passages}) and batch_size "
                    f"({config.batch_size}) of a dump must be at least 1")
  positions = model.config.max_position_embeddings
  if config.max_seq_length > positions:  # positions past the table embed as NaN (jnp.take)
    raise DumpError(f"dump windows of {config.max_seq_length} tokens (index.dump_max_seq_length "
                    f"or data.max_seq_length) exceed the model's {positions} positions")
  model = with_compute_dtype(model, config.compute_dtype or compute_dtype(model))
  return model, dataclasses.replace(
      config, compute_dtype=compute_dtype(model),
      width_multiple=phrase_calls(config.batch_size, mesh, config.width_multiple)[1])


def _shards_to_encode(out_dir: pathlib.Path, chunks: Iterable[list], counts: dict):
  """(number, passages) of the shards this process still has to encode (counting all shards
  and the ones already done)."""
  for number, chunk in enumerate(chunks):
    counts["shards"] += 1
    if not distributed.process_share(number):
      continue
    if (out_dir / shard_name(number) / SHARD_INFO).is_file():
      _check_shard(out_dir, read_json(out_dir / shard_name(number) / SHARD_INFO, DumpError,
                                      "delete that shard's directory to encode it again"),
                   chunk)
      counts["resumed"] += 1
      continue
    yield number, chunk


def _encode_pipelined(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
                      progress: Progress, timings: dict, maker: WindowMaker, made: dict,
                      pipeline: list, dim: int) -> None:
  """Encodes and writes shards with the host work off the encoder's path: the next shards are
  tokenized (`maker`: as many ahead as it has workers) and each is written batch by batch by a
  worker thread (`ShardStream`) while it is encoded. `made`: shard number -> future of its
  windows. `pipeline` receives the seconds this thread waits for windows and writes."""

  ahead: collections.deque = collections.deque()

  def top_up():
    while len(ahead) < max(maker.workers, 1) and (job := next(todo, None)) is not None:
      ahead.append((*job, made.pop(job[0], None) or maker.submit(job[1])))

  with concurrent.futures.ThreadPoolExecutor(1) as write:
    writing: list[concurrent.futures.Future] = []
    current: list[ShardStream] = []  # the shard being encoded
    failed: list[BaseException] = []  # the first failed write, whichever shard asks next

    def stream() -> ShardStream:
      current.append(ShardStream(out_dir, shard_name(number), dim, write, failed))
      return current[-1]

    top_up()
    try:
      while ahead:
        number, chunk, windows = ahead.popleft()
        if not isinstance(windows, list):  # blocks (shard 0) are waited for one by one
          windows = _timed_result(windows, pipeline)
        top_up()
        for done in [w for w in writing if w.done()]:  # a failed write stops the dump now
          done.result()
        arrays = encode_shard(tokenizer, chunk, config, mesh, encode, progress,
                              windows=windows, timings=timings, stream=stream,
                              pipeline=pipeline)
        writing.append(current.pop().finish(len(arrays["token_passage"])))
      for w in writing:
        _timed_result(w, pipeline)
    finally:
      for unfinished in current:  # an error while encoding it: its files closed
        unfinished.close()


def passages_digest(passages: Iterable[Passage]) -> str:
  """A short hash of passages' ids, titles and texts (what a shard holds)."""
  return digest_texts(*(f"{p.id}\x1f{p.title}\x1f{p.text}" for p in passages))


def _check_corpus(out_dir: pathlib.Path, shards: list[dict], chunks: Iterable[list]) -> None:
  """Refuses a corpus whose shards of passages differ from those the complete dump holds."""
  for shard, chunk in itertools.zip_longest(shards, chunks):
    if shard is None or chunk is None:
      raise DumpError(f"{out_dir} holds a dump of {len(shards)} shards, but the corpus now gives "
                      f"{'more' if shard is None else 'fewer'} passages: the corpus changed; "
                      "dump it into a new index.dump_name (or delete the directory)")
    _check_shard(out_dir, shard, chunk)


def _check_shard(out_dir: pathlib.Path, shard: dict, chunk: list) -> None:
  if "passages_sha" in shard and shard["passages_sha"] != passages_digest(chunk):
    raise DumpError(f"{out_dir / shard['name']} holds other passages than the corpus gives now: "
                    "the corpus changed since this dump was made; dump it into a new "
                    "index.dump_name (or delete the directory)")


def _existing(out_dir: pathlib.Path, manifest: dict) -> dict | None:
  """The manifest of a dump already in `out_dir` (None if none); one of another model or
  settings is refused."""
  if not (out_dir / MANIFEST).exists():
    return None
  old = read_json(out_dir / MANIFEST, DumpError, "delete the dump's directory and dump again")
  # A dump from before these settings existed: doc_stride windows, float32.
  settings = {"min_context": 0, "compute_dtype": "float32", **old["settings"]}
  if old["fingerprint"] != manifest["fingerprint"]:
    raise DumpError(f"{out_dir} holds a dump of another model; use a new directory (or delete it)")
  if settings != manifest["settings"]:
    differ = ", ".join(f"{k} {settings.get(k)!r} (now {v!r})"
                       for k, v in manifest["settings"].items() if settings.get(k) != v)
    raise DumpError(f"{out_dir} holds a dump with other settings: {differ}; use a new directory "
                    "(index.dump_name) or delete it")
  # (manifests from before these were recorded: not compared). A complete dump is not touched
  # again: its tokenization is its own (its serialisation may change with the library), but its
  # filter logits must be the workdir's head's.
  checked = (("filter_head", "another token filter head (filter_head.npz)"),) + (
      () if old.get("complete") else (("tokenizer", "another tokenizer"),))
  for key, what in checked:
    if key in old and old[key] != manifest[key]:
      raise DumpError(f"{out_dir} holds a dump made with {what} ({old[key]}, now "
                      f"{manifest[key]}); use a new directory (index.dump_name) or delete it")
  return old


def _prepare(out_dir: pathlib.Path, manifest: dict) -> None:
  """Removes what a killed run left unfinished and marks the dump incomplete."""
  if distributed.is_main():
    for leftover in out_dir.glob("*.tmp"):  # a shard a killed run did not finish
      remove(leftover)
    write_manifest(out_dir, manifest)
  distributed.barrier("dump-start")


def _finish(out_dir: pathlib.Path, manifest: dict, num_shards: int, seconds: float) -> dict:
  """Once every process's shards exist, process 0 marks the dump complete."""
  distributed.barrier("dump-shards")
  if distributed.is_main():
    manifest["shards"] = [json.loads((out_dir / shard_name(n) / SHARD_INFO).read_text())
                          for n in range(num_shards)]
    manifest.update(complete=True,
                    num_passages=sum(s["passages"] for s in manifest["shards"]),
                    num_tokens=sum(s["tokens"] for s in manifest["shards"]),
                    # the windows' real tokens (None: a shard made before they were counted)
                    encoded_tokens=_total(manifest["shards"], "encoded_tokens"),
                    num_windows=_total(manifest["shards"], "windows"),
                    seconds=seconds, processes=jax.process_count())
    # What an index built from this dump records, to be refused against any other dump.
    manifest["dump_id"] = digest_texts(manifest["fingerprint"], json.dumps(manifest["settings"]),
                                       *(s.get("passages_sha", "") for s in manifest["shards"]))
    write_manifest(out_dir, manifest)
  distributed.barrier("dump-manifest")
  return read_manifest(out_dir)


def _total(shards: list[dict], key: str) -> int | None:
  """The shards' `key` summed (None if a shard lacks it)."""
  return sum(s[key] for s in shards) if all(key in s for s in shards) else None


def shard_name(number: int) -> str:
  return f"shard_{number:05d}"


def shard_token_offsets(manifest: dict) -> np.ndarray:
  """Global id of each shard's first token (and the total at the end), [num_shards + 1]."""
  return np.concatenate([[0], np.cumsum([s["tokens"] for s in manifest["shards"]])]).astype(
      np.int64)


@dataclasses.dataclass
class Dump:
  """A complete dump loaded into memory (vectors kept float16)."""

  directory: pathlib.Path
  manifest: dict
  vectors: np.ndarray  # [T, D] float16
  filter_logits: np.ndarray  # [T, 2] float16
  token_passage: np.ndarray  # [T] int32, global passage row
  char_spans: np.ndarray  # [T, 2] int32
  passages: list[Passage]

  @classmethod
  def load(cls, directory: str | os.PathLike, *, verify: bool = False) -> "Dump":
    """The dump in `directory`; its shards' file sizes checked against those recorded, and with
    `verify` their contents (`check_shards`)."""
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    check_shards(directory, manifest, contents=verify)
    arrays = {k: [] for k in ("vectors", "filter_logits", "token_passage", "char_spans")}
    passages, offset = [], 0
    for shard in manifest["shards"]:
      path = directory / shard["name"]
      try:
        for key in arrays:
          value = np.load(path / f"{key}.npy")
          arrays[key].append(value + offset if key == "token_passage" else value)
        with (path / "passages.jsonl").open(encoding="utf-8") as f:
          passages.extend(Passage(**json.loads(line)) for line in f)
      except (OSError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: shard is missing or damaged ({type(e).__name__}: {e}); "
                        "delete the dump and run it again") from None
      offset = len(passages)
    joined = {k: np.concatenate(v) for k, v in arrays.items()}
    if len(joined["vectors"]) != manifest["num_tokens"] or len(passages) != manifest[
        "num_passages"]:
      raise DumpError(f"{directory}: shard contents do not match the manifest counts")
    return cls(directory, manifest, passages=passages, **joined)
