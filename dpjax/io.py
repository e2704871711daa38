"""Atomic file and directory writes, content digests, a workdir lock and console progress
(layer 0: numpy, tqdm and the standard library).

Every file dpjax writes that a later run reads (reports, manifests, corpora, shards, indexes)
goes through these helpers: a crash or kill leaves the old file or the new one, never half of one,
and a temporary left by a killed run has a name no reader takes for the real thing.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import time
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from dpjax.errors import BusyError

log = logging.getLogger(__name__)


def _temporary(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_lines_atomic(path: str | os.PathLike, lines: Iterable[str]) -> None:
  """Streams `lines` (each ending in a newline, or not: written as given) into `path` atomically."""
  path = pathlib.Path(path)
  tmp = _temporary(path)
  try:
    with tmp.open("w", encoding="utf-8") as f:
      for line in lines:
        f.write(line)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes a file so that a crash leaves the old file or the new one, never half of one."""
  write_lines_atomic(path, [text])


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, **kwargs) -> None:
  """`obj` as (indented) JSON, written atomically (reports, manifests, predictions)."""
  write_text_atomic(path, json.dumps(obj, indent=indent, **kwargs))


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
  """One JSON object per line (UTF-8, non-ASCII kept), written atomically."""
  write_lines_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def save_npy_atomic(path: str | os.PathLike, array: np.ndarray) -> None:
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.npy")
  try:
    np.save(tmp, array)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def remove(path: pathlib.Path) -> None:
  """Removes a file or a directory tree, if it exists."""
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  else:
    path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, cleanup: bool = True) -> Iterator[pathlib.Path]:
  """Yields an empty `<final>.tmp` directory to fill; on success it replaces `final` whole.

  On an exception the temporary directory is removed (`cleanup=False` keeps it, for callers that
  resume from it) and `final` is left as it was.
  """
  final = pathlib.Path(final)
  tmp = final.with_name(final.name + ".tmp")
  remove(tmp)
  tmp.mkdir(parents=True)
  try:
    yield tmp
  except BaseException:
    if cleanup:
      remove(tmp)
    raise
  commit_directory(tmp, final)


def commit_directory(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
  """Puts a complete directory `tmp` in the place of `final` (replacing an older one)."""
  remove(pathlib.Path(final))
  os.replace(tmp, final)


def digest_texts(*texts: str, length: int = 16) -> str:
  """A short sha256 of strings (each length-prefixed, so the parts cannot run into each other)."""
  h = hashlib.sha256()
  for text in texts:
    data = text.encode("utf-8", "surrogatepass")
    h.update(len(data).to_bytes(8, "little") + data)
  return h.hexdigest()[:length]


def digest(*arrays, length: int = 16) -> str:
  """A short sha256 of arrays' bytes (parameter and data fingerprints)."""
  h = hashlib.sha256()
  for array in arrays:
    h.update(np.ascontiguousarray(array).tobytes())
  return h.hexdigest()[:length]


@contextlib.contextmanager
def workdir_lock(path: str | os.PathLike, what: str = "training"):
  """Holds the lock file `path` (e.g. `<workdir>/train.lock`) for one run: a second run of the
  same kind in the workdir would delete the first one's checkpoints and interleave its metrics
  (a BusyError). A lock whose process is gone (a killed run) is taken over. The lock file is
  created with its pid in it at once (hard link of a written file), so no reader sees it empty.
  """
  path = pathlib.Path(path)
  pid = _lock_holder(path)
  if pid and _process_alive(pid):  # this process too: a nested run in one workdir
    raise BusyError(f"{path}: another {what} run (pid {pid}) is using this workdir; wait for it, "
                    "or run in a second workdir")
  if pid is not None:
    log.warning("%s: taking over the lock of a run that is gone (pid %s)", path, pid or "?")
    path.unlink(missing_ok=True)
  tmp = _temporary(path)
  tmp.write_text(str(os.getpid()))
  try:
    os.link(tmp, path)
  except FileExistsError:
    raise BusyError(f"{path}: could not take the lock (another {what} run took it)") from None
  finally:
    tmp.unlink(missing_ok=True)
  try:
    yield
  finally:
    path.unlink(missing_ok=True)


def _lock_holder(path: pathlib.Path) -> int | None:
  """The pid in a lock file (0 if unreadable), or None when there is no lock."""
  try:
    return int(path.read_text().strip() or 0)
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    return 0


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # PermissionError (someone else's live process) counts as alive
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


class Progress:
  """Progress of a long stage with its throughput: a tqdm bar on a terminal, otherwise (logs,
  nohup) an INFO line every `interval` seconds and one at the end. `update(n, **postfix)`."""

  def __init__(self, desc: str, total: int | None = None, unit: str = "it", *,
               interval: float = 30.0, logger: logging.Logger | None = None):
    self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
    self.log = logger or log
    self.done, self.start = 0, time.perf_counter()
    self.last = self.start
    self.bar = (tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)
                if sys.stderr.isatty() else None)

  def update(self, n: int, **postfix) -> None:
    self.done += n
    if self.bar is not None:
      self.bar.update(n)
      if postfix:
        self.bar.set_postfix(postfix, refresh=False)
    elif time.perf_counter() - self.last >= self.interval:
      self.last = time.perf_counter()
      self._log(postfix)

  def close(self, **postfix) -> None:
    if self.bar is not None:
      self.bar.close()
    else:
      self._log(postfix)

  def _log(self, postfix: dict) -> None:
    seconds = time.perf_counter() - self.start
    of = f"/{self.total}" if self.total else ""
    extra = "".join(f", {key} {value}" for key, value in postfix.items())
    self.log.info("%s: %d%s %s in %.0f s (%.1f %s/s%s)", self.desc, self.done, of, self.unit,
                  seconds, self.done / max(seconds, 1e-9), self.unit, extra)
