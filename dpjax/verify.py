"""`run.py verify`: every artifact of a workdir read back and checked against the sizes and
digests recorded when it was written (`dpjax.io.file_checksum`): each checkpoint step (of
`checkpoints`, `checkpoints_best`, `checkpoints_qsft`, the teacher's), each shard of each dump,
each faiss index and the token filter head. A damaged file is named with what remakes it and the
run exits with status 2; an artifact written before digests were recorded is reported as
unverified, not refused.
"""
from __future__ import annotations

import functools
import logging
import os
import pathlib
from typing import Callable, Iterator

from dpjax.checkpoint import checkpoint_problems, checkpoint_rerun
from dpjax.errors import DataError, DumpError
from dpjax.index.faiss_index import index_problems
from dpjax.index.manifest import INDEX_MANIFEST, MANIFEST as DUMP_MANIFEST
from dpjax.index.shards import SHARD_INFO, shard_problems, shard_rerun
from dpjax.index.sparse import BUILD_HINT, MANIFEST as SPARSE_MANIFEST
from dpjax.io import checksum_problems, read_json
from dpjax.layout import Workdir
from dpjax.workdir import read_filter_head

log = logging.getLogger(__name__)
# An artifact's check: (its problems, or None when no digests were recorded; what remakes it).
Check = Callable[[], tuple]


def run_verify(config, workdir: str) -> dict:
  """`run.py verify`: checks every artifact of `workdir`; returns the paths verified, unverified
  and damaged ({path: problems}); any damaged one is a DataError naming them (exit 2)."""
  del config  # what is checked is what the workdir holds, whatever the config names
  workdir = Workdir(workdir)
  if not workdir.is_dir():
    raise DataError(f"{workdir}: no such workdir (check --workdir)")
  report = {"verified": [], "unverified": [], "damaged": {}}
  for path, check in _artifacts(workdir):
    try:
      problems, rerun = check()
    except (DataError, DumpError) as e:  # a record that cannot be read: that is the damage
      problems, rerun = [str(e)], ""
    if problems is None:
      log.warning("%s: unverified (written before digests were recorded)", path)
      report["unverified"].append(str(path))
    elif problems:
      for problem in problems:
        log.error("%s%s", problem, f"; {rerun}" if rerun else "")
      report["damaged"][str(path)] = problems
    else:
      report["verified"].append(str(path))
  log.info("verify %s: %d artifacts verified, %d unverified, %d damaged", workdir,
           len(report["verified"]), len(report["unverified"]), len(report["damaged"]))
  if report["damaged"]:
    raise DataError(f"{workdir}: {len(report['damaged'])} damaged artifacts: "
                    f"{', '.join(report['damaged'])} (each file and what to rerun above)")
  return report


def _artifacts(workdir: Workdir) -> Iterator[tuple[pathlib.Path, Check]]:
  """(path, check) of every artifact under `workdir`, found by what its folder holds; the
  temporary folders of unfinished writes (`*.tmp`, never read) are skipped."""
  if workdir.filter_head.is_file():
    yield workdir.filter_head, functools.partial(_filter_head, workdir.filter_head)
  for folder, dirs, files in os.walk(workdir):
    dirs[:] = sorted(d for d in dirs if not d.endswith(".tmp"))
    here = pathlib.Path(folder)
    if here.name.isdigit() and "state" in dirs:  # an Orbax checkpoint step
      dirs[:] = []
      yield here, functools.partial(_checkpoint, here)
    elif DUMP_MANIFEST in files and any(d.startswith("shard_") for d in dirs):  # a dump
      dirs[:] = [d for d in dirs if d == "indexes"]  # its shards are checked here
      yield from _dump_shards(here)
    elif INDEX_MANIFEST in files:
      yield here, functools.partial(_index, here)
    elif SPARSE_MANIFEST in files:
      yield here, functools.partial(_sparse, here)


def _checkpoint(step_dir: pathlib.Path) -> tuple:
  return checkpoint_problems(step_dir, contents=True), checkpoint_rerun(step_dir)


def _index(directory: pathlib.Path) -> tuple:
  manifest = read_json(directory / INDEX_MANIFEST, DumpError,
                       "build the index again with `run.py index`")
  problems = (index_problems(directory, manifest, contents=True) if "files" in manifest
              else None)
  return problems, "build the index again with `run.py index`"


def _sparse(directory: pathlib.Path) -> tuple:
  manifest = read_json(directory / SPARSE_MANIFEST, DumpError, BUILD_HINT)
  problems = (checksum_problems(directory, manifest["files"], contents=True)
              if "files" in manifest else None)  # (None: no digests to verify against)
  return problems, BUILD_HINT


def _filter_head(path: pathlib.Path) -> tuple:
  read_filter_head(path)  # (a DataError names the damage)
  return [], ""


def _dump_shards(dump_dir: pathlib.Path) -> Iterator[tuple[pathlib.Path, Check]]:
  """The shards of a dump: those its manifest lists when complete, else every finished one."""
  try:
    manifest = read_json(dump_dir / DUMP_MANIFEST, DumpError,
                         "delete the dump's directory and dump again")
  except DumpError as e:
    yield dump_dir / DUMP_MANIFEST, lambda: ([str(e)], "")
    return
  if manifest.get("complete"):
    entries = [(dump_dir / s["name"], s) for s in manifest.get("shards", [])]
  else:
    entries = [(info.parent, None) for info in sorted(dump_dir.glob(f"shard_*/{SHARD_INFO}"))]
  for shard, entry in entries:
    yield shard, functools.partial(_shard, shard, entry)


def _shard(shard: pathlib.Path, entry: dict | None) -> tuple:
  if entry is None:  # a shard of an unfinished dump: its own record
    entry = read_json(shard / SHARD_INFO, DumpError, shard_rerun(shard))
  problems = shard_problems(shard, entry, contents=True) if "files" in entry else None
  return problems, shard_rerun(shard)
