"""The teacher's start/end logits over training examples, written once and read by distillation.

A directory (`run.py teacher` writes `<workdir>/teacher/logits`): `manifest.json` (the fingerprint:
the teacher's parameters and step, the training features, the window length; the rows it covers;
`complete`; once complete, each shard's files' sizes and digests, `checksums`, which a load checks
by size and `run.py verify` by contents) and shards `shard_NNNNN/` of `rows.npy` [n] (training
feature rows) and `logits.npy` [n, 2, L] float16 (start, end, at the phrase model's window
positions). Shards are renamed into place whole, so a killed run resumes with the missing ones; a
directory written for another teacher or other data is refused, never mixed or silently used.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Callable

import numpy as np

from dpjax.errors import DataError
from dpjax.io import (Progress, atomic_directory, checksum_problems, digest, folder_checksums,
                      refuse_damage, write_json)

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def write_teacher_logits(directory: str | os.PathLike, fingerprint: dict, rows: np.ndarray,
                         compute: Callable[[np.ndarray], np.ndarray], *,
                         shard_rows: int = 4096, main: bool = True,
                         barrier: Callable[[str], None] = lambda name: None) -> dict:
  """Writes (or resumes) the logits `compute(rows) -> [n, 2, L]` of `rows`; returns the manifest.

  With several processes (`compute` then a collective call every process makes) each process
  runs this: all of them decide which shards are missing before any is written (`barrier`),
  compute those in step, and only the `main` one writes (one writer per file).

  Raises:
    DataError: the directory holds logits of another fingerprint or other rows.
  """
  directory = pathlib.Path(directory)
  rows = np.asarray(rows, np.int64)
  shards = [rows[i:i + shard_rows] for i in range(0, len(rows), shard_rows)]
  # Which rows, not only how many: another run's examples (another train.seed) are as many.
  manifest = {"fingerprint": fingerprint, "rows": len(rows), "rows_digest": digest(rows),
              "shard_rows": shard_rows,
              "shards": [f"shard_{n:05d}" for n in range(len(shards))], "complete": False}
  old = _read_manifest(directory)
  if old is not None:  # (one written before rows_digest existed is taken as of these rows)
    old = {"rows_digest": manifest["rows_digest"], **old}
  keys = ("fingerprint", "rows", "rows_digest", "shard_rows")
  if old is not None and {k: old.get(k) for k in keys} != {k: manifest[k] for k in keys}:
    raise DataError(f"{directory} holds teacher logits of another teacher, other data or other "
                    f"rows ({_differences(old, manifest)}); delete it or write elsewhere")
  if old is not None and old["complete"]:
    return old
  missing = [not (directory / name / "logits.npy").is_file() for name in manifest["shards"]]
  barrier("teacher-logits-start")  # every process has decided before the first write
  if main:
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / MANIFEST, manifest)
  progress = Progress("teacher logits", len(rows), "examples", logger=log)
  for name, part, todo in zip(manifest["shards"], shards, missing):
    if todo:
      logits = np.asarray(compute(part), np.float16)
      if logits.shape[:2] != (len(part), 2):
        raise ValueError(f"compute gave logits of shape {logits.shape} for {len(part)} rows")
      if main:
        with atomic_directory(directory / name) as tmp:
          np.save(tmp / "rows.npy", part)
          np.save(tmp / "logits.npy", logits)
    progress.update(len(part))
  progress.close()
  manifest["complete"] = True
  if main:
    manifest["checksums"] = {name: folder_checksums(directory / name)
                             for name in manifest["shards"]}
    write_json(directory / MANIFEST, manifest)
  barrier("teacher-logits-done")  # complete for every process once it returns
  return manifest


def _read_manifest(directory: pathlib.Path) -> dict | None:
  path = directory / MANIFEST
  if not path.is_file():
    return None
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: not valid JSON ({e}); delete {directory} and write it "
                    "again") from None


def logits_problems(directory: str | os.PathLike, *, contents: bool,
                    reuse_stamps: bool = True) -> list[str] | None:
  """What is wrong with a complete logits directory's shard files against the sizes (and with
  `contents` the digests) its manifest records (`io.checksum_problems`); None for one written
  before they were recorded."""
  directory = pathlib.Path(directory)
  manifest = _read_manifest(directory)
  if manifest is None:
    return [f"{directory / MANIFEST}: missing"]
  if "checksums" not in manifest:
    return None
  return [problem for name in manifest["shards"]
          for problem in checksum_problems(directory / name, manifest["checksums"].get(name, {}),
                                           contents=contents, reuse_stamps=reuse_stamps)]


def _differences(old: dict, new: dict) -> str:
  keys = sorted(set(old["fingerprint"]) | set(new["fingerprint"]))
  diff = [f"{k}: {old['fingerprint'].get(k)!r} -> {new['fingerprint'].get(k)!r}" for k in keys
          if old["fingerprint"].get(k) != new["fingerprint"].get(k)]
  if old.get("rows") != new["rows"]:
    diff.append(f"rows: {old.get('rows')} -> {new['rows']}")
  elif old["rows_digest"] != new["rows_digest"]:
    diff.append(f"rows: other {new['rows']} rows")
  return "; ".join(diff) or "shard size"


class TeacherLogits:
  """A complete logits directory, in memory: `batch(rows)` gives the distillation inputs."""

  def __init__(self, directory: str | os.PathLike, *, data: str, length: int):
    """Loads `directory`, refusing an incomplete one or one written for other training data
    (`data`: the features' fingerprint) or another window length."""
    self.directory = pathlib.Path(directory)
    manifest = _read_manifest(self.directory)
    if manifest is None or not manifest["complete"]:
      raise DataError(f"{self.directory}: no complete teacher logits (run `run.py teacher` "
                      "first; it resumes)")
    fingerprint = manifest["fingerprint"]
    if fingerprint.get("data") != data or fingerprint.get("length") != length:
      raise DataError(f"{self.directory} holds teacher logits of other training data or window "
                      f"length (data {fingerprint.get('data')} vs {data}, length "
                      f"{fingerprint.get('length')} vs {length}); run `run.py teacher` again")
    self.fingerprint = fingerprint
    refuse_damage(logits_problems(self.directory, contents=False), DataError,
                  "teacher logits file", f"delete {self.directory} and run `run.py teacher` again")
    parts = []
    for name in manifest["shards"]:
      try:
        parts.append((np.load(self.directory / name / "rows.npy"),
                      np.load(self.directory / name / "logits.npy")))
      except (OSError, ValueError) as e:
        raise DataError(f"{self.directory / name}: unreadable shard ({e}); delete the "
                        "directory and run `run.py teacher` again") from None
    rows = np.concatenate([r for r, _ in parts])
    self.logits = np.concatenate([x for _, x in parts])
    self.slot = np.full(int(rows.max()) + 1 if len(rows) else 0, -1, np.int64)
    self.slot[rows] = np.arange(len(rows))

  def missing(self, rows: np.ndarray) -> int:
    """How many of `rows` the logits do not cover."""
    rows = np.asarray(rows)
    inside = rows < len(self.slot)
    return int((~inside).sum() + (self.slot[rows[inside]] < 0).sum())

  def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    """`teacher_start_logits` and `teacher_end_logits`, [n, L] float32, of feature rows."""
    if self.missing(rows):
      raise DataError(f"{self.directory} has no teacher logits for {self.missing(rows)} of "
                      "this batch's examples")
    logits = self.logits[self.slot[rows]].astype(np.float32)
    return {"teacher_start_logits": logits[:, 0], "teacher_end_logits": logits[:, 1]}
