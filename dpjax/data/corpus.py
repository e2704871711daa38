"""Corpora to index: SQuAD-format JSON or JSONL passages, streamed, with ids and titles.

Accepted inputs:
  - SQuAD-format JSON: `data[].title`, `data[].paragraphs[].context` (questions are ignored);
    passage ids are `<file stem>-<article>-<paragraph>` unless a paragraph has an `id`.
  - JSONL, one passage per line: `{"id": ..., "title": ..., "text": ...}` (`contents` is accepted
    for `text`, as in Pyserini); read line by line, so memory does not grow with the file.
Bad records (invalid JSON line, no text, empty text, duplicate id) are skipped and counted, and so
are exact repeats of a passage (same title and text), which would only duplicate index entries.

`python -m dpjax.data.corpus squad FILE [FILE ...] --out corpus.jsonl` writes the unique
paragraphs of SQuAD files as a JSONL corpus (train + dev v1.1: 20,963 paragraphs, 5 of them verbatim
repeats of another paragraph of the same article, so 20,958 passages).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
from typing import Iterable, Iterator

from dpjax.data.squad import DataError, Passage, SkipSummary, load_json, valid_unicode
from dpjax.io import write_jsonl


def _is_jsonl(path: pathlib.Path) -> bool:
  if path.suffix in (".jsonl", ".ndjson"):
    return True
  if path.suffix == ".json":
    return False
  with path.open("rb") as f:  # sniff: a JSONL file's first line is a complete object
    first = f.readline().strip()
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
  texts: set[tuple[str, str]] = set()
  for path in map(pathlib.Path, paths):
    if not path.is_file():
      raise DataError(f"{path}: corpus file not found")
    records = _read_jsonl(path, summary) if _is_jsonl(path) else _read_squad(path, summary)
    for passage, where in records:
      if not valid_unicode(passage.id, passage.title, passage.text):
        summary.skip("invalid Unicode (a lone surrogate) in id, title or text", where)
        continue
      if passage.id in seen:
        summary.skip("duplicate passage id", where)
        continue
      if (passage.title, passage.text) in texts:
        summary.skip("repeated passage (same title and text)", where)
        continue
      seen.add(passage.id)
      texts.add((passage.title, passage.text))
      yield passage


def _read_jsonl(path: pathlib.Path, summary: SkipSummary):
  with path.open("rb") as f:
    for number, raw in enumerate(f, 1):
      where = f"{path}:{number}"
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
      if not isinstance(record, dict):
        summary.skip("line is not a JSON object", where)
        continue
      text = record.get("text", record.get("contents"))
      if not isinstance(text, str) or not text.strip():
        summary.skip("passage without text", where)
        continue
      pid = record.get("id", record.get("_id"))
      pid = str(pid) if pid is not None else f"{path.stem}-{number}"
      yield Passage(pid, str(record.get("title") or ""), text), where


def _read_squad(path: pathlib.Path, summary: SkipSummary):
  root = load_json(path)
  if not isinstance(root, dict) or not isinstance(root.get("data"), list):
    raise DataError(f"{path}: expected a JSON object with a 'data' list (SQuAD format) "
                    "or one JSON object per line (JSONL)")
  for a, article in enumerate(root["data"]):
    if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
      summary.skip("article without a 'paragraphs' list", f"{path}: data[{a}]")
      continue
    title = str(article.get("title") or "")
    for p, paragraph in enumerate(article["paragraphs"]):
      where = f"{path}: data[{a}].paragraphs[{p}]"
      text = paragraph.get("context") if isinstance(paragraph, dict) else None
      if not isinstance(text, str) or not text.strip():
        summary.skip("paragraph without context", where)
        continue
      pid = paragraph.get("id") or f"{path.stem}-{a}-{p}"
      yield Passage(str(pid), title, text), where


def squad_to_jsonl(paths: Iterable[str | os.PathLike], out: str | os.PathLike) -> int:
  """Writes the unique (title, context) paragraphs of SQuAD files as JSONL; returns the count."""
  passages = list(read_corpus(paths))
  write_jsonl(out, map(dataclasses.asdict, passages))
  return len(passages)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="Corpus tools.")
  sub = parser.add_subparsers(dest="command", required=True)
  squad = sub.add_parser("squad", help="SQuAD JSON files -> unique paragraphs as JSONL")
  squad.add_argument("files", nargs="+")
  squad.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  try:
    count = squad_to_jsonl(args.files, args.out)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {count} passages to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
