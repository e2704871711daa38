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
text), which would only duplicate index entries.

`python -m dpjax.data.corpus squad FILE [FILE ...] --out corpus.jsonl` writes the unique
paragraphs of SQuAD files as a JSONL corpus (train + dev v1.1: 20,963 paragraphs, 5 of them verbatim
repeats of another paragraph of the same article, so 20,958 passages).
"""
from __future__ import annotations

import argparse
import codecs
import collections
import dataclasses
import json
import os
import pathlib
import sys
from typing import Iterable, Iterator

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
                summary: SkipSummary | None = None) -> Iterator[Passage]:
  """Streams passages from one or more corpus files; skips and counts bad records in `summary`."""
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  summary = summary if summary is not None else SkipSummary()
  summary.path = ", ".join(map(str, paths))
  seen: set[str] = set()
  made: dict[str, int] = {}  # the ids made for records without one: the index of their file
  texts: set[tuple[str, str]] = set()
  paths = list(map(pathlib.Path, paths))
  twice = [path for path, n in collections.Counter(p.resolve() for p in paths).items() if n > 1]
  if twice:
    raise DataError(f"{twice[0]}: corpus file given more than once")
  for index, (path, prefix) in enumerate(zip(paths, _id_prefixes(paths))):
    for passage, where, generated in _records(path, prefix, summary):
      if not valid_unicode(passage.id, passage.title, passage.text):
        summary.skip("invalid Unicode (a lone surrogate) in id, title or text", where)
        continue
      if passage.id in seen:
        if generated or passage.id in made:
          made_in = paths[made[passage.id]] if passage.id in made else None
          raise DataError(_id_clash(passage.id, where, generated, made_in))
        summary.skip("duplicate passage id", where)
        continue
      if (passage.title, passage.text) in texts:
        summary.skip("repeated passage (same title and text)", where)
        continue
      seen.add(passage.id)
      if generated:
        made[passage.id] = index
      texts.add((passage.title, passage.text))
      yield passage


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
