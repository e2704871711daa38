"""A compact index's passages (`PassageStore`): their ids, titles and texts in zlib-compressed
blocks of one file, read a block at a time, so that a search over a compact index reads no
`passages.jsonl` and holds in memory only the blocks it read last.

The index folder (`PassageWriter` writes these) holds:

  passages.bin           the blocks, one after another
  passage_blocks.npy     [2, B + 1] int64  each block's first byte in passages.bin (row 0) and
                                           first passage row (row 1), the totals last
  passage_documents.npy  [P] int64  each passage's document (`units.document_key`) as a 64-bit
                                    digest: passages of one document share it

A block holds whole passages, in row order; decompressed, it is a [n, 3] little-endian uint32
array of the UTF-8 byte lengths of each passage's id, title and text, then those fields one after
another. A block is closed before it would pass `BLOCK_BYTES` of fields, so a passage longer
than that is a block alone.
"""
from __future__ import annotations

import collections
import hashlib
import operator
import os
import pathlib
import threading
import zlib
from typing import Iterable, Iterator, Sequence

import numpy as np

from dpjax.data.squad import Passage
from dpjax.errors import DumpError
from dpjax.index.units import document_key

DATA, BLOCKS, DOCUMENTS = "passages.bin", "passage_blocks.npy", "passage_documents.npy"
FILES = (DATA, BLOCKS, DOCUMENTS)
# Fields per block before compression: twice zlib's window (repeats further apart are not
# found), and what reading one passage decompresses besides it.
BLOCK_BYTES = 1 << 16
# Decompressed blocks a store keeps (least recently read dropped first), at most 32 MiB of
# fields: the passages of a search's results are read several times (phrase text, sentence
# scores, result), and the next searches' often lie in blocks read before; a corpus of a few
# hundred blocks is then read from memory (results/reread_window_cache.md).
CACHE_BLOCKS = 512
REBUILD = "build the index again with `run.py index`"
_HEADER = np.dtype("<u4")


def document_digest(passage: Passage) -> int:
  """A 64-bit digest (signed) of the passage's document (`units.document_key`); a title and an
  untitled passage's id hash apart even when their texts are equal."""
  key = document_key(passage)
  text = b"t" + key.encode("utf-8") if isinstance(key, str) else b"i" + key[1].encode("utf-8")
  return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


class PassageWriter:
  """Writes a store's files into `directory`: passages added in row order, compressed a block
  at a time and appended with their document digests (memory holds one block's fields, nothing
  mapped). `close` (or leaving the `with`) finishes it, a DumpError when other than
  `num_passages` were added."""

  def __init__(self, directory: pathlib.Path, num_passages: int, *,
               block_bytes: int = BLOCK_BYTES):
    self.directory, self.num_passages, self.block_bytes = directory, num_passages, block_bytes
    self._file = open(directory / DATA, "wb")
    self._documents = open(directory / DOCUMENTS, "wb")
    np.lib.format.write_array_header_1_0(self._documents, {
        "descr": np.lib.format.dtype_to_descr(np.dtype("<i8")), "fortran_order": False,
        "shape": (num_passages,)})
    self._bounds = [(0, 0)]  # (first byte, first row) of each block written, and the end
    self._fields: list[bytes] = []
    self._digests: list[int] = []
    self._size = self._rows = 0

  def add(self, passage: Passage) -> None:
    """Appends the next passage row."""
    fields = [str(value).encode("utf-8") for value in (passage.id, passage.title, passage.text)]
    size = sum(map(len, fields))
    if self._fields and self._size + size > self.block_bytes:
      self._flush()
    if self._rows >= self.num_passages:
      raise DumpError(f"{self.directory / DATA}: more than the {self.num_passages} passages of "
                      "the dump's manifest")
    self._digests.append(document_digest(passage))
    self._fields += fields
    self._size += size
    self._rows += 1

  def _flush(self) -> None:
    if not self._fields:
      return
    lengths = np.array([len(f) for f in self._fields], _HEADER)
    self._file.write(zlib.compress(lengths.tobytes() + b"".join(self._fields)))
    self._documents.write(np.array(self._digests, "<i8").tobytes())
    self._bounds.append((self._file.tell(), self._rows))
    self._fields, self._digests, self._size = [], [], 0

  def close(self) -> None:
    """Writes the last block and the blocks' offsets."""
    if self._file.closed:
      return
    self._flush()
    self._file.close()
    self._documents.close()
    if self._rows != self.num_passages:
      raise DumpError(f"{self.directory / DATA}: {self._rows} passages written, "
                      f"{self.num_passages} in the dump's manifest")
    np.save(self.directory / BLOCKS, np.array(self._bounds, np.int64).T.copy())

  def __enter__(self) -> "PassageWriter":
    return self

  def __exit__(self, kind, value, traceback) -> None:
    if kind is None:
      self.close()
    else:  # (the build removes the folder)
      self._file.close()
      self._documents.close()


def write_passages(directory: pathlib.Path, passages: Iterable[Passage], num_passages: int,
                   **options) -> None:
  """Writes `num_passages` passages (in row order) as a store into `directory`."""
  with PassageWriter(directory, num_passages, **options) as writer:
    for passage in passages:
      writer.add(passage)


class PassageStore(Sequence):
  """The passages of a store, by row: a read-only sequence of `Passage` decompressed a block at
  a time, the last `cache_blocks` blocks kept (shared between threads); iteration decompresses
  each block once, keeping none.

  `documents`: [P] int64 each passage's document digest (`document_digest`), memory mapped.
  A part of other shapes than `num_passages` needs, or a block that does not decompress to its
  passages, is a DumpError naming the file.
  """

  def __init__(self, directory: pathlib.Path, num_passages: int, *,
               cache_blocks: int = CACHE_BLOCKS):
    self.path = directory / DATA
    blocks = _load(directory / BLOCKS)
    size = self.path.stat().st_size if self.path.is_file() else -1
    if (blocks.ndim != 2 or blocks.shape[0] != 2 or blocks.shape[1] < 1
        or blocks[0, 0] != 0 or blocks[1, 0] != 0 or blocks[0, -1] != size
        or blocks[1, -1] != num_passages or (np.diff(blocks, axis=1) < 0).any()):
      raise DumpError(f"{directory / BLOCKS}: not the blocks of {num_passages} passages in "
                      f"{self.path} ({size} bytes); {REBUILD}")
    self.documents = _load(directory / DOCUMENTS)
    if self.documents.shape != (num_passages,):
      raise DumpError(f"{directory / DOCUMENTS}: of shape {self.documents.shape}, "
                      f"({num_passages},) expected; {REBUILD}")
    self._offsets, self._first_rows = blocks[0], blocks[1]
    self._file = open(self.path, "rb")
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._cache_blocks = max(1, cache_blocks)
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self._first_rows[-1])

  def __getitem__(self, row):
    if isinstance(row, slice):
      return [self[i] for i in range(*row.indices(len(self)))]
    row = operator.index(row)
    if row < 0:
      row += len(self)
    if not 0 <= row < len(self):
      raise IndexError(f"passage row {row} of {len(self)}")
    block = int(np.searchsorted(self._first_rows, row, "right")) - 1
    return self._block(block)[row - int(self._first_rows[block])]

  def __iter__(self) -> Iterator[Passage]:
    for block in range(len(self._offsets) - 1):
      yield from self._decode(block)

  def _block(self, block: int) -> tuple[Passage, ...]:
    """A block's passages, from the cache or decompressed (and cached)."""
    with self._lock:
      found = self._cache.get(block)
      if found is not None:
        self._cache.move_to_end(block)
        return found
    found = self._decode(block)
    with self._lock:
      self._cache[block] = found
      while len(self._cache) > self._cache_blocks:
        self._cache.popitem(last=False)
    return found

  def _decode(self, block: int) -> tuple[Passage, ...]:
    start, end = int(self._offsets[block]), int(self._offsets[block + 1])
    rows = int(self._first_rows[block + 1] - self._first_rows[block])
    data = os.pread(self._file.fileno(), end - start, start)
    try:
      raw = zlib.decompress(data)
      lengths = np.frombuffer(raw, _HEADER, 3 * rows) if len(raw) >= 12 * rows else None
      bounds = (None if lengths is None else
                np.concatenate([[12 * rows], 12 * rows + np.cumsum(lengths, dtype=np.int64)]))
      if bounds is None or bounds[-1] != len(raw) or len(data) != end - start:
        raise ValueError("its fields do not add up to its length")
      bounds = bounds.tolist()
      fields = [raw[bounds[i]:bounds[i + 1]].decode("utf-8") for i in range(3 * rows)]
    except (zlib.error, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
      raise DumpError(f"{self.path}: block {block} (bytes {start}-{end}) is damaged "
                      f"({type(e).__name__}: {str(e).splitlines()[0]}); {REBUILD}") from None
    return tuple(Passage(*fields[i:i + 3]) for i in range(0, len(fields), 3))


def _load(path: pathlib.Path) -> np.ndarray:
  """A store's array, memory mapped; a DumpError naming it when unreadable."""
  try:
    return np.load(path, mmap_mode="r")
  except (OSError, ValueError) as e:
    raise DumpError(f"{path}: unreadable ({type(e).__name__}: {e}); {REBUILD}") from None
