"""The windows a dump encodes its passages in, made ahead of the encoder (`WindowMaker`), and
their kept tokens (one copy of each context token: its "max context" window's)."""
from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
from typing import Iterator

import numpy as np

from dpjax.data.squad import Passage
from dpjax.data.windows import (build_windows, windows_worker, windows_worker_ready,
                                windows_worker_setup)
from dpjax.data.tokenization import Tokenizer
from dpjax.errors import DumpError
from dpjax.index.manifest import DumpConfig, window_settings


# Shard 0's windows are made in blocks of 64, 128, 256, ... passages (`WindowMaker.submit_blocks`):
# the encoder waits for 64 passages to be tokenized, not a shard's worth, at the start of a dump,
# and the blocks' calls encode about the whole shard's tokens (`encode_shard`). On a CPU the
# tokenizer's thread then runs beside the encoder's threads on the same cores, yet dumps were as
# fast in blocks as whole, with less host time in the main thread (results/code_measurements.md).
FIRST_BLOCK = 64


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
      job.add_done_callback(functools.partial(forward_result, windows))

    self.handing.submit(hand_over)
    return windows

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.handing.shutdown(wait=True)
    for pool in (self.thread, self.processes):
      if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def forward_result(to: concurrent.futures.Future, done: concurrent.futures.Future) -> None:
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


def kept_slices(runs: dict, rows: np.ndarray,
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
