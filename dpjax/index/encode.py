"""A shard's passages encoded by the jitted phrase encoder: its kept tokens' vectors and filter
logits, in passage order (`encode_shard`); a dump's shards encoded one after another with the
host work (tokenizing, writing) off the encoder's path (`encode_pipelined`)."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import pathlib
import time
from typing import ClassVar, Iterator

import numpy as np

from dpjax.data.squad import Passage
from dpjax.data.tokenization import Tokenizer
from dpjax.index.manifest import DumpConfig
from dpjax.index.shard_stream import ShardStream
from dpjax.index.shards import shard_name
from dpjax.index.window_maker import WindowMaker, kept_runs, kept_slices, shard_windows
from dpjax.io import Progress
from dpjax.models.encoders import phrase_batches, phrase_calls


def encode_shard(tokenizer: Tokenizer, passages: list[Passage], config: DumpConfig,
                 mesh, encode, progress: Progress | None = None,
                 windows=None, timings: dict | None = None, stream=None,
                 pipeline: list | None = None, pad_last: bool = True) -> dict[str, np.ndarray]:
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
  tokens: `windows`, `encoded_tokens`). `pad_last` (`map_batches`): the last call of a width
  padded to the full rows, one compiled shape per width for a long job; False for a few passages
  (re-reading's), padded to a power of two only."""
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
      block = timed_result(block, pipeline)
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
    stored += _encode_windows(todo, total, config, mesh, encode, progress, timings, sink, out,
                              pad_last)
  if stored != total:  # every window comes back once
    raise AssertionError(f"{total - stored} of {total} kept tokens were not encoded")
  return {**tables, **out}


def timed_result(future: concurrent.futures.Future, seconds: list | None):
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
                    out: dict[str, np.ndarray], pad_last: bool = True) -> int:
  """Encodes windows; their kept tokens go to `sink`, or to `out`'s arrays (grown to the
  shard's `total` kept tokens so far). Returns the tokens stored."""
  # Batches of similar length (no compute on padding) come back out of order: each window's
  # runs of kept tokens are copied straight to their rows in passage order (slices, no gather).
  stored = 0
  for rows, (vectors, logits) in phrase_batches(encode, windows.input_ids,
                                                windows.attention_mask,
                                                batch_size=config.batch_size, mesh=mesh,
                                                width_multiple=config.width_multiple,
                                                timings=timings, pad_last=pad_last):
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


def _place(runs: dict, rows: np.ndarray, width: int, *pairs) -> int:
  """Copies the kept runs of a batch's windows (`rows`, outputs `width` wide) from each
  (batch output [B, width, ...], shard array) pair; returns the tokens copied."""
  count = 0
  for b, column, length, destination in kept_slices(runs, rows, width):
    for batch_output, shard in pairs:
      shard[destination:destination + length] = batch_output[b, column:column + length]
    count += length
  return count


def first_shards_ahead(maker: WindowMaker, todo: Iterator, made: dict) -> Iterator:
  """Starts the workers and hands them the first `workers` shards after shard 0 (and shard 0
  unless `made` has it) now, so that they are tokenized while the encoder compiles; returns
  the shards to encode, these first. (Handed over as the encoder took them, the first shards
  after shard 0 were begun after the compiles, and the encoder then waited for them.)"""
  maker.start()
  first = list(itertools.islice(todo, maker.workers + 1))
  made.update({number: maker.submit(chunk) for number, chunk in first if number not in made})
  return itertools.chain(first, todo)


def encode_pipelined(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
                     progress: Progress, timings: dict, maker: WindowMaker, made: dict,
                     pipeline: list, dim: int) -> None:
  """Encodes and writes shards with the host work off the encoder's path: the next shards are
  tokenized (`maker`: as many ahead as it has workers) and each is written batch by batch by a
  worker thread (`ShardStream`) while it is encoded, then sealed (checksums, sync, rename) by
  another while the next is written. `made`: shard number -> future of its windows. `pipeline`
  receives the seconds this thread waits for windows and writes; `timings` those waits for the
  writes at the end under "write_wait"."""

  ahead: collections.deque = collections.deque()

  def top_up():
    while len(ahead) < max(maker.workers, 1) and (job := next(todo, None)) is not None:
      ahead.append((*job, made.pop(job[0], None) or maker.submit(job[1])))

  # (The sealer outlives the writer, which hands it each finished shard.)
  with concurrent.futures.ThreadPoolExecutor(1) as seal, \
       concurrent.futures.ThreadPoolExecutor(1) as write:
    writing: list[concurrent.futures.Future] = []
    current: list[ShardStream] = []  # the shard being encoded
    failed: list[BaseException] = []  # the first failed write, whichever shard asks next

    def stream() -> ShardStream:
      current.append(ShardStream(out_dir, shard_name(number), dim, write, failed, seal))
      return current[-1]

    top_up()
    try:
      while ahead:
        number, chunk, windows = ahead.popleft()
        if not isinstance(windows, list):  # blocks (shard 0) are waited for one by one
          windows = timed_result(windows, pipeline)
        top_up()
        for done in [w for w in writing if w.done()]:  # a failed write stops the dump now
          done.result()
        arrays = encode_shard(tokenizer, chunk, config, mesh, encode, progress,
                              windows=windows, timings=timings, stream=stream,
                              pipeline=pipeline)
        writing.append(current.pop().finish(len(arrays["token_passage"])))
      drain: list[float] = []  # waiting for the writes queued behind the encoder
      for w in writing:
        timed_result(w, drain)
      pipeline.extend(drain)
      timings["write_wait"] = timings.get("write_wait", 0.0) + sum(drain)
    finally:
      for unfinished in current:  # an error while encoding it: its files closed
        unfinished.close()
