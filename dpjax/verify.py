"""`run.py verify`: every artifact of a workdir read back and checked against the sizes and
digests recorded when it was written (`dpjax.io.file_checksum`): each checkpoint step (of
`checkpoints`, `checkpoints_best`, `checkpoints_qsft`, the teacher's), each shard of each dump,
each faiss and BM25 index, the teacher's logits and the token filter head. Every byte is read
(verified stamps are not trusted here: a disk fault can keep a file's times).

A damaged file is named with what remakes it, and so is what an artifact lacks to be checked at
all: a dump without its manifest, a checkpoint step without its `state/`, an index folder
without its manifest. The run then exits with status 2. An artifact without digests (written
before they were recorded) is reported as unverified and also exits 2, unless
`--allow_unverified` accepts it.
"""
from __future__ import annotations

import functools
import logging
import os
import pathlib
from typing import Callable, Iterator

from dpjax.checkpoint import CHECKSUMS, checkpoint_problems, checkpoint_rerun
from dpjax.data.teacher_logits import logits_problems
from dpjax.errors import DumpError
from dpjax.index.faiss_index import index_problems
from dpjax.index.manifest import (INDEX_MANIFEST, MANIFEST as DUMP_MANIFEST,
                                  dump_coding_files)
from dpjax.index.shards import SHARD_INFO, shard_rerun
from dpjax.index.sparse import BUILD_HINT, MANIFEST as SPARSE_MANIFEST
from dpjax.io import checksum_problems, file_digest, read_json
from dpjax.workdir import CHECKPOINTS, Workdir
from dpjax.loading import read_filter_head

log = logging.getLogger(__name__)
# An artifact's check: (its problems, or None when it has no digests to check; what remakes it,
# or for one without digests why it has none).
Check = Callable[[], tuple]
OLD = "written before digests were recorded"
DUMP_AGAIN = "delete the dump's directory and dump again"
INDEX_AGAIN = "build the index again with `run.py index`"


def artifacts(workdir: Workdir) -> Iterator[tuple[pathlib.Path, Check]]:
  """(path, check) of every artifact under `workdir`, found by what its folder holds; the
  temporary folders of unfinished writes (`*.tmp`, never read) are skipped."""
  if workdir.filter_head.is_file():
    yield workdir.filter_head, functools.partial(_filter_head, workdir.filter_head)
  for folder, dirs, files in os.walk(workdir):
    dirs[:] = sorted(d for d in dirs if not d.endswith(".tmp"))
    here = pathlib.Path(folder)
    shards = [d for d in dirs if d.startswith("shard_")]
    if _is_checkpoint_step(here, dirs, files):
      dirs[:] = []
      yield here, functools.partial(_checkpoint, here)
    elif shards and _is_teacher_logits(here, shards):
      dirs[:] = []
      yield here, functools.partial(_teacher_logits, here)
    elif shards:  # a dump: its shards are checked here, its indexes below
      dirs[:] = [d for d in dirs if d == "indexes"]
      yield from _dump_shards(here, has_manifest=DUMP_MANIFEST in files)
    elif INDEX_MANIFEST in files:
      yield here, functools.partial(_index, here)
    elif SPARSE_MANIFEST in files:
      yield here, functools.partial(_sparse, here)
    elif here.name == "indexes" and any(here.parent.glob("shard_*")):  # a dump's indexes
      for name in dirs:
        if not {INDEX_MANIFEST, SPARSE_MANIFEST} & {p.name for p in (here / name).iterdir()}:
          yield here / name, functools.partial(_missing, here / name / INDEX_MANIFEST,
                                               "an index folder without its manifest",
                                               INDEX_AGAIN)


def _is_checkpoint_step(here: pathlib.Path, dirs: list[str], files: list[str]) -> bool:
  """An Orbax checkpoint step's folder (`<kind>/<step>/`), whole or with its state gone."""
  return here.name.isdigit() and (here.parent.name in CHECKPOINTS.values() or "state" in dirs
                                  or "meta" in dirs or CHECKSUMS in files)


def _is_teacher_logits(here: pathlib.Path, shards: list[str]) -> bool:
  """Teacher logits' shards hold `logits.npy`, a dump's its `SHARD_INFO`."""
  return (not any((here / d / SHARD_INFO).is_file() for d in shards)
          and any((here / d / "logits.npy").is_file() for d in shards))


def _teacher_logits(directory: pathlib.Path) -> tuple:
  problems = logits_problems(directory, contents=True, reuse_stamps=False)
  rerun = f"delete {directory} and run `run.py teacher` again"
  return (problems, rerun) if problems is not None else (None, OLD)


def _missing(path: pathlib.Path, what: str, rerun: str) -> tuple:
  return [f"{path}: missing ({what}: nothing to check it by)"], rerun


def _checkpoint(step_dir: pathlib.Path) -> tuple:
  if not (step_dir / "state").is_dir():  # a restore would pass over it for an earlier step
    return _missing(step_dir / "state", "a checkpoint step without its saved arrays",
                    checkpoint_rerun(step_dir))
  problems = checkpoint_problems(step_dir, contents=True, reuse_stamps=False)
  return problems, checkpoint_rerun(step_dir) if problems is not None else OLD


def _index(directory: pathlib.Path) -> tuple:
  manifest = read_json(directory / INDEX_MANIFEST, DumpError, INDEX_AGAIN)
  if "files" not in manifest:
    return None, OLD
  return index_problems(directory, manifest, contents=True, reuse_stamps=False), INDEX_AGAIN


def _sparse(directory: pathlib.Path) -> tuple:
  manifest = read_json(directory / SPARSE_MANIFEST, DumpError, BUILD_HINT)
  if "files" not in manifest:
    return None, OLD
  return (checksum_problems(directory, manifest["files"], contents=True, reuse_stamps=False),
          BUILD_HINT)


def _filter_head(path: pathlib.Path) -> tuple:
  read_filter_head(path)  # (a DataError names the damage)
  return [], ""


def _dump_shards(dump_dir: pathlib.Path, *,
                 has_manifest: bool) -> Iterator[tuple[pathlib.Path, Check]]:
  """The shards of a dump: those its manifest lists when complete, else every finished one (a
  dump without its manifest is damaged itself, and its shards checked by their own records)."""
  manifest = {}
  if not has_manifest:
    yield dump_dir / DUMP_MANIFEST, functools.partial(
        _missing, dump_dir / DUMP_MANIFEST, "a dump's shards without its manifest", DUMP_AGAIN)
  else:
    try:
      manifest = read_json(dump_dir / DUMP_MANIFEST, DumpError, DUMP_AGAIN)
      if not (isinstance(manifest, dict) and all(isinstance(s, dict) and "name" in s
                                                 for s in manifest.get("shards", []))):
        raise DumpError(f"{dump_dir / DUMP_MANIFEST}: not a dump's manifest; {DUMP_AGAIN}")
    except DumpError as e:
      problem = str(e)  # (`e` is unbound once the except block ends; the check runs later)
      yield dump_dir / DUMP_MANIFEST, lambda: ([problem], "")
      return
  if manifest.get("complete"):
    entries = [(dump_dir / s["name"], s) for s in manifest.get("shards", [])]
  else:
    entries = [(info.parent, None) for info in sorted(dump_dir.glob(f"shard_*/{SHARD_INFO}"))]
  for shard, entry in entries:
    yield shard, functools.partial(_shard, shard, entry)
  if "codec" in manifest:  # the coding its shards' codes were made with (`dump_codes`)
    for name, sha in dump_coding_files(manifest["codec"]).items():
      yield dump_dir / name, functools.partial(_codec, dump_dir / name, sha)


def _codec(path: pathlib.Path, sha: str) -> tuple:
  problem = ("missing" if not path.is_file() else
             "other bytes than when written" if file_digest(path) != sha else None)
  return [f"{path}: {problem}"] if problem else [], DUMP_AGAIN


def _shard(shard: pathlib.Path, entry: dict | None) -> tuple:
  if entry is None:  # a shard of an unfinished dump: its own record
    entry = read_json(shard / SHARD_INFO, DumpError, shard_rerun(shard))
  if "files" not in entry:
    return None, OLD
  # (`shard_problems` with every file, reading every byte)
  return (checksum_problems(shard, entry["files"], contents=True, reuse_stamps=False),
          shard_rerun(shard))
