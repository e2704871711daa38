"""Corpora to index: SQuAD-format JSON or JSONL passages, streamed, with ids and titles.

Accepted inputs:
  - SQuAD-format JSON: `data[].title`, `data[].paragraphs[].context` (questions are ignored);
    passage ids are `<file stem>-<article>-<paragraph>` unless a paragraph has an `id`.
  - JSONL, one passage per line: `{"id": ..., "title": ..., "text": ...}` (`contents` is accepted
    for `text`, as in Pyserini); read line by line, so memory does not grow with the file. A
    record without an id (or with an empty one) gets `<file stem>-<line>`.
  Ids are strings or numbers. Generated ids of several files with one stem are prefixed by the
  files' folders (`x/part-3`, `y/part-3`), and by their names where one folder holds several
  (`part.jsonl-3`, `part.ndjson-3`); a generated id equal to another passage's id is an error
  (give every record an id). A file that cannot be read is an error naming it.
Bad records (invalid JSON line, no text, empty text, an id that is neither a string nor a number,
duplicate id) are skipped and counted, and so are exact repeats of a passage (same title and
text), which would only duplicate index entries. These checks remember a 16-byte digest of each
id and of each passage (`DigestTable`), not the strings: what a read of the corpus holds grows by
a fixed-size slot per passage, not by its text.

`python -m dpjax.data.corpus squad FILE [FILE ...] --out corpus.jsonl` writes the unique
paragraphs of SQuAD files as a JSONL corpus (train + dev v1.1: 20,963 paragraphs, 5 of them verbatim
repeats of another paragraph of the same article, so 20,958 passages).
"""
from __future__ import annotations

import argparse
import codecs
import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
from typing import Iterable, Iterator

import numpy as np

from dpjax.data.squad import (JSON_ERRORS, Passage, SkipSummary, json_problem, load_json,
                              title_text, valid_unicode)
from dpjax.errors import DataError
from dpjax.io import write_jsonl


def is_jsonl(path: pathlib.Path) -> bool:
  """Whether a file is JSONL: `.jsonl` / `.ndjson`, or not `.json` and its first line is one
  JSON object (not a `{"data": ...}` file)."""
  if path.suffix in (".jsonl", ".ndjson"):
    return True
  if path.suffix == ".json":
    return False
  with path.open("rb") as f:  # sniff: a JSONL file's first non-blank line is a complete object
    first = f.readline().removeprefix(codecs.BOM_UTF8)
    while first and not first.strip():
      first = f.readline()
  first = first.strip()
  try:
    return isinstance(json.loads(first), dict) and "data" not in json.loads(first)
  except (json.JSONDecodeError, UnicodeDecodeError):
    return False


def read_corpus(paths: str | os.PathLike | Iterable[str | os.PathLike],
                summary: SkipSummary | None = None) -> "Corpus":
  """The passages of one or more corpus files, streamed (`Corpus`: each iteration reads the
  files again); skips and counts bad records in `summary`."""
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  return Corpus([pathlib.Path(path) for path in paths],
                summary if summary is not None else SkipSummary())


@dataclasses.dataclass
class Corpus:
  """Corpus files' passages: every iteration reads the files from the start (a dump reads a
  corpus more than once: its codec's sample, then its shards). The first iteration counts the
  records it skips in `summary`; later ones skip the same records and count nothing. What an
  iteration remembers of the passages read (their ids, their title and text, for the repeat
  checks) is a fixed-size digest of each (`DigestTable`), not the strings."""
  paths: list[pathlib.Path]
  summary: SkipSummary
  _counted: bool = dataclasses.field(default=False, init=False, repr=False)

  def __iter__(self) -> Iterator[Passage]:
    paths, summary = self.paths, self.summary if not self._counted else SkipSummary()
    self._counted = True
    summary.path = ", ".join(map(str, paths))
    twice = [path for path, n in collections.Counter(p.resolve() for p in paths).items() if n > 1]
    if twice:
      raise DataError(f"{twice[0]}: corpus file given more than once")
    # each id seen: 0 for a record's own, 1 + the index of its file for one made for a record
    # without an id
    ids, texts = DigestTable(value_bytes=4), DigestTable()
    for index, (path, prefix) in enumerate(zip(paths, _id_prefixes(paths))):
      for passage, where, generated in _records(path, prefix, summary):
        if not valid_unicode(passage.id, passage.title, passage.text):
          summary.skip("invalid Unicode (a lone surrogate) in id, title or text", where)
          continue
        key = digest(passage.id)
        id_slot, made = ids.find(key)
        if made is not None:
          if generated or made:
            raise DataError(_id_clash(passage.id, where, generated,
                                      paths[made - 1] if made else None))
          summary.skip("duplicate passage id", where)
          continue
        text_key = digest(passage.title, passage.text)
        text_slot, repeated = texts.find(text_key)
        if repeated is not None:
          summary.skip("repeated passage (same title and text)", where)
          continue
        ids.insert(id_slot, key, index + 1 if generated else 0)
        texts.insert(text_slot, text_key)
        yield passage


DIGEST_BYTES = 16
_EMPTY = bytes(DIGEST_BYTES)


def digest(*texts: str) -> bytes:
  """A 16-byte blake2b digest of strings (each length-prefixed: the parts cannot run into each
  other); never all zero bytes (`DigestTable`'s empty slot)."""
  h = hashlib.blake2b(digest_size=DIGEST_BYTES)
  for text in texts:
    data = text.encode("utf-8", "surrogatepass")
    h.update(len(data).to_bytes(8, "little") + data)
  key = h.digest()
  return key if key != _EMPTY else b"\x01" * DIGEST_BYTES


class DigestTable:
  """A set of `digest`s, each with a number of `value_bytes` bytes, in one bytearray (open
  addressing, linear probing, kept at most 3/4 full): what it holds per member is a slot of
  16 + `value_bytes` bytes whatever the strings digested, where a set of the strings holds them
  all (a corpus read for a dump would grow by its text)."""

  def __init__(self, value_bytes: int = 0, slots: int = 1 << 12):
    self.width = DIGEST_BYTES + value_bytes
    self.slots, self.size = slots, 0
    self.table = bytearray(slots * self.width)

  def __len__(self) -> int:
    return self.size

  def find(self, key: bytes) -> tuple[int, int | None]:
    """(the byte offset of `key`'s slot, or of the empty one where `insert` puts it; the
    number stored with it, None when it is not there)."""
    table, width, mask = self.table, self.width, self.slots - 1
    slot = int.from_bytes(key[:8], "little") & mask
    while True:
      at = slot * width
      stored = table[at:at + DIGEST_BYTES]
      if stored == key:
        return at, int.from_bytes(table[at + DIGEST_BYTES:at + width], "little")
      if stored == _EMPTY:
        return at, None
      slot = (slot + 1) & mask

  def insert(self, at: int, key: bytes, value: int = 0) -> None:
    """Stores `key` (not there) with `value` at `find`'s offset for it (no insert since)."""
    self.table[at:at + self.width] = key + value.to_bytes(self.width - DIGEST_BYTES, "little")
    self.size += 1
    if self.size * 4 > self.slots * 3:
      self._grow()

  def _grow(self) -> None:
    """Twice the slots, the members placed again (in rounds, all at once: a member moves on
    from its slot only when another holds it, as a probe would)."""
    width, old = self.width, np.frombuffer(self.table, np.uint8).reshape(self.slots, self.width)
    members = old[(old[:, :DIGEST_BYTES] != 0).any(1)]
    self.slots *= 2
    table = np.zeros((self.slots, width), np.uint8)
    slots = members[:, :8].copy().view("<u8")[:, 0] & np.uint64(self.slots - 1)
    waiting = np.arange(len(members))
    while len(waiting):
      free = ~table[slots[waiting], :DIGEST_BYTES].any(1)
      taken, first = np.unique(slots[waiting[free]], return_index=True)
      table[taken] = members[waiting[free][first]]
      placed = np.zeros(len(waiting), bool)
      placed[np.flatnonzero(free)[first]] = True
      waiting = waiting[~placed]
      slots[waiting] = (slots[waiting] + np.uint64(1)) & np.uint64(self.slots - 1)
    self.table = bytearray(table.tobytes())


def _records(path: pathlib.Path, prefix: str, summary: SkipSummary):
  """A corpus file's (passage, where, generated id?) records; a read error (an unreadable file,
  a disk fault) is a DataError naming the file, not an OSError a caller could take for its own
  write's."""
  try:
    if not path.is_file():
      raise DataError(f"{path}: corpus file not found")
    yield from (_read_jsonl(path, prefix, summary) if is_jsonl(path)
                else _read_squad(path, prefix, summary))
  except OSError as e:
    raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def _id_clash(passage_id: str, where: str, generated: bool, made_in: pathlib.Path | None) -> str:
  """The error for an id seen before where either is one made for a record without an id
  (`made_in`: the file of the earlier one, if it was made)."""
  if generated and made_in is not None:
    return (f"{where}: id {passage_id!r} made for this record without an id was also made for a "
            f"record without an id in {made_in}: give every record an 'id'")
  return (f"{where}: id {passage_id!r} is both a record's own and one made for a record without "
          "an id: give every record an 'id'")


def _id_prefixes(paths: list[pathlib.Path]) -> list[str]:
  """The prefix of each file's generated ids: its stem, or, where several files share a stem,
  its path from their common folder without the suffix ('x/part', 'y/part'), with it where that
  is still shared ('c/part.jsonl', 'c/part.ndjson': two files of one folder)."""
  stems = collections.Counter(path.stem for path in paths)
  shared = [path.resolve() for path in paths if stems[path.stem] > 1]
  root = pathlib.Path(os.path.commonpath(shared)) if shared else None
  names = [path.resolve().relative_to(root) if stems[path.stem] > 1 else None for path in paths]
  bare = collections.Counter(name.with_suffix("") for name in names if name is not None)
  return [path.stem if name is None
          else (name if bare[name.with_suffix("")] > 1 else name.with_suffix("")).as_posix()
          for path, name in zip(paths, names)]


def _passage_id(value, generated: str, where: str, summary: SkipSummary):
  """(id, generated?) of a record's id field: a string or number, else (empty or missing) the
  generated id; None (skipped and counted) for any other JSON value."""
  if value is None or value == "":
    return generated, True
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    summary.skip("id is neither a string nor a number", where)
    return None
  return str(value), False


def _read_jsonl(path: pathlib.Path, prefix: str, summary: SkipSummary):
  with path.open("rb") as f:
    for number, raw in enumerate(f, 1):
      where = f"{path}:{number}"
      raw = raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw  # (a byte-order mark)
      if not raw.strip():
        continue
      try:
        record = json.loads(raw.decode("utf-8"))
      except UnicodeDecodeError:
        summary.skip("line is not valid UTF-8", where)
        continue
      except json.JSONDecodeError as e:
        summary.skip("invalid JSON line", f"{where} column {e.colno}")
        continue
      except JSON_ERRORS as e:  # a huge integer, deep nesting
        summary.skip("invalid JSON line", f"{where} ({json_problem(e)})")
        continue
      if not isinstance(record, dict):
        summary.skip("line is not a JSON object", where)
        continue
      text = record.get("text", record.get("contents"))
      if not isinstance(text, str) or not text.strip():
        summary.skip("passage without text", where)
        continue
      pid = _passage_id(record.get("id", record.get("_id")), f"{prefix}-{number}", where, summary)
      if pid is not None:
        yield Passage(pid[0], title_text(record.get("title")), text), where, pid[1]


def _read_squad(path: pathlib.Path, prefix: str, summary: SkipSummary):
  root = load_json(path)
  if not isinstance(root, dict) or not isinstance(root.get("data"), list):
    raise DataError(f"{path}: expected a JSON object with a 'data' list (SQuAD format) "
                    "or one JSON object per line (JSONL)")
  for a, article in enumerate(root["data"]):
    if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
      summary.skip("article without a 'paragraphs' list", f"{path}: data[{a}]")
      continue
    title = title_text(article.get("title"))
    for p, paragraph in enumerate(article["paragraphs"]):
      where = f"{path}: data[{a}].paragraphs[{p}]"
      text = paragraph.get("context") if isinstance(paragraph, dict) else None
      if not isinstance(text, str) or not text.strip():
        summary.skip("paragraph without context", where)
        continue
      pid = _passage_id(paragraph.get("id"), f"{prefix}-{a}-{p}", where, summary)
      if pid is not None:
        yield Passage(pid[0], title, text), where, pid[1]


def squad_to_jsonl(paths: Iterable[str | os.PathLike], out: str | os.PathLike,
                   summary: SkipSummary | None = None) -> int:
  """Writes the unique (title, context) paragraphs of SQuAD files as JSONL; returns the count.
  `summary` counts the records skipped."""
  passages = list(read_corpus(paths, summary))
  pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
  write_jsonl(out, map(dataclasses.asdict, passages))
  return len(passages)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="Corpus tools.")
  sub = parser.add_subparsers(dest="command", required=True)
  squad = sub.add_parser("squad", help="SQuAD JSON files -> unique paragraphs as JSONL")
  squad.add_argument("files", nargs="+")
  squad.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  summary = SkipSummary()
  try:
    count = squad_to_jsonl(args.files, args.out, summary)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # (reading errors are DataErrors naming the input file)
    failed = f" ({e.filename})" if e.filename and str(e.filename) != args.out else ""
    print(f"error: {args.out}: cannot write{failed}: {e.strerror or e}", file=sys.stderr)
    return 2
  if summary.total:
    print(summary, file=sys.stderr)
  print(f"wrote {count} passages to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
