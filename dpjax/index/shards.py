"""A dump's shards on disk: written atomically, sealed with their files' sizes and digests, checked.

A shard holds, for `shard_passages` passages:

  vectors.npy        [T, D] float16  token vectors h_t
  filter_logits.npy  [T, 2] float16  start/end logits of the token-filter head
  token_passage.npy  [T]    int32    passage row (global) of each token
  char_spans.npy     [T, 2] int32    characters [start, end) of each token in its passage text
  passages.jsonl                     {"id", "title", "text"} of the shard's passages

(A dump filtered or coded at dump time keeps other arrays, of its kept tokens only:
`dpjax.index.dump_codes`.)

  shard.json                         {"name", "passages", "tokens", "passages_sha", "files"}

Shards are written into `<name>.tmp` and renamed when complete (`write_shard`, or batch by batch
by `dpjax.index.shard_stream.ShardStream`). Every shard records a hash of its passages, so that a
dump is never resumed or reused with another corpus.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import pathlib
from typing import Iterable

import numpy as np

from dpjax.data.squad import Passage
from dpjax.errors import DumpError
from dpjax.index.manifest import MANIFEST
from dpjax.io import (atomic_directory, checksum_problems, digest_texts, file_checksum,
                      folder_checksums, refuse_damage, write_json, write_jsonl)

log = logging.getLogger(__name__)
SHARD_INFO = "shard.json"


def shard_name(number: int) -> str:
  return f"shard_{number:05d}"


def shard_token_offsets(manifest: dict) -> np.ndarray:
  """Global id of each shard's first token (and the total at the end), [num_shards + 1]."""
  return np.concatenate([[0], np.cumsum([s["tokens"] for s in manifest["shards"]])]).astype(
      np.int64)


def passages_digest(passages: Iterable[Passage]) -> str:
  """A short hash of passages' ids, titles and texts (what a shard holds)."""
  return digest_texts(*(f"{p.id}\x1f{p.title}\x1f{p.text}" for p in passages))


def write_shard(directory: pathlib.Path, name: str, arrays: dict[str, np.ndarray],
                passages: list[Passage], info: dict | None = None, *,
                tokens: int | None = None) -> dict:
  """Writes one shard atomically (temporary directory, then rename); returns its manifest entry
  (with `info`'s fields; `tokens`: its token count, else its vectors'). An unfinished shard of
  an older layout in its place is replaced."""
  tokens = len(arrays["vectors"]) if tokens is None else tokens
  try:
    with atomic_directory(directory / name) as tmp:
      return seal_shard(tmp, write_shard_files(tmp, name, arrays, passages, tokens, info))
  except OSError as e:  # disk full, read-only, quota: name the place and the cause
    raise write_error(directory / name, e) from None


def write_shard_files(tmp: pathlib.Path, name: str, arrays: dict[str, np.ndarray],
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


def is_kept_shard(entry: dict) -> bool:
  """Whether a shard is of the kept-token layout (`dpjax.index.dump_codes`)."""
  return entry.get("layout") == "kept"


def shard_context_offsets(manifest: dict) -> np.ndarray:
  """Global id, counted in encoded tokens (before a dump-time filter), of each shard's first
  token (and the total at the end), [num_shards + 1]: `shard_token_offsets` of an unfiltered
  dump."""
  return np.concatenate([[0], np.cumsum([s.get("context_tokens", s["tokens"])
                                         for s in manifest["shards"]])]).astype(np.int64)


def shard_token_layout(shard_dir: pathlib.Path, entry: dict) -> tuple[np.ndarray, np.ndarray,
                                                                      np.ndarray]:
  """(token_passage [K] int32 shard-local passage row of each stored token, its id among the
  shard's encoded tokens [K] int64, each passage's encoded tokens [P] int64), of either layout."""
  if not is_kept_shard(entry):
    token_passage = np.load(shard_dir / "token_passage.npy")
    encoded = np.bincount(token_passage, minlength=entry["passages"])
    return token_passage, np.arange(len(token_passage), dtype=np.int64), encoded
  counts = np.load(shard_dir / "passage_tokens.npy").astype(np.int64)  # [P, 2] kept, encoded
  token_passage = np.repeat(np.arange(len(counts), dtype=np.int32), counts[:, 0])
  first = np.concatenate([[0], np.cumsum(counts[:, 1])[:-1]])
  ids = first[token_passage] + np.load(shard_dir / "positions.npy").astype(np.int64)
  return token_passage, ids, counts[:, 1]


def seal_shard(shard: pathlib.Path, entry: dict) -> dict:
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


def check_shards(directory: pathlib.Path, manifest: dict, *, contents: bool = False,
                 names: Iterable[str] | None = None) -> None:
  """Refuses a dump whose shard files (`names`: those only) are missing, of other sizes or
  (`contents`) of other bytes than when written: one DumpError naming the first such file and
  what to rerun. A dump from before digests were recorded is used, with a warning that it is
  unverified."""
  for shard in manifest["shards"]:
    refuse_damage(shard_problems(directory / shard["name"], shard, contents=contents,
                                 names=names),
                  DumpError, "dump", shard_rerun(directory / shard["name"]))
  if any("files" not in shard for shard in manifest["shards"]):
    log.warning("%s: a dump made before digests were recorded: its shards are unverified",
                directory)


def check_shard_passages(out_dir: pathlib.Path, shard: dict, chunk: list) -> None:
  if "passages_sha" in shard and shard["passages_sha"] != passages_digest(chunk):
    raise DumpError(f"{out_dir / shard['name']} holds other passages than the corpus gives now: "
                    "the corpus changed since this dump was made; dump it into a new "
                    "index.dump_name (or delete the directory)")


def write_error(shard: pathlib.Path, e: OSError) -> DumpError:
  """The cause as the OS names it (errno's meaning); freeing space is advised only when space
  is what ran out (a file removed under the dump, by another run, is not a full disk)."""
  cause = os.strerror(e.errno) if e.errno else str(e)
  where = f" ({e.filename})" if e.filename and str(e.filename) != str(shard) else ""
  advice = ("free space and run the dump again (it resumes)"
            if e.errno in (errno.ENOSPC, errno.EDQUOT) else "run the dump again (it resumes)")
  return DumpError(f"{shard}: could not write the shard: {cause} (errno {e.errno}){where}; "
                   f"{advice}")
