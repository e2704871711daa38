"""Atomic file and directory writes, content digests, a workdir lock and console progress
(layer 0: numpy, tqdm and the standard library).

Every file dpjax writes that a later run reads (reports, manifests, corpora, shards, indexes)
goes through these helpers: a crash or kill leaves the old file or the new one, never half of one,
and a temporary left by a killed run has a name no reader takes for the real thing.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shlex
import shutil
import socket
import sys
import time
import zlib
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from dpjax.errors import BusyError, DataError

log = logging.getLogger(__name__)


def _temporary(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_lines_atomic(path: str | os.PathLike, lines: Iterable[str]) -> None:
  """Streams `lines` (each ending in a newline, or not: written as given) into `path` atomically."""
  _write_atomic(path, lambda f: f.writelines(line.encode("utf-8") for line in lines))


def _write_atomic(path: str | os.PathLike, write, suffix: str = "") -> None:
  """`write(binary file)` into a temporary file, fsynced, renamed to `path`, the rename fsynced:
  a kill or an OS crash leaves the old file or the new one, never half of one."""
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.stem if suffix else path.name}.tmp{os.getpid()}{suffix}")
  try:
    with tmp.open("wb") as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)
  finally:
    tmp.unlink(missing_ok=True)


def fsync_directory(directory: str | os.PathLike) -> None:
  """Makes the renames and new entries in `directory` durable: after an OS crash or power loss a
  rename could otherwise be on disk before the data it points at (an empty "complete" file)."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError as e:  # file systems that cannot fsync a directory (some network/FUSE ones)
    if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
      raise
  finally:
    os.close(fd)


def fsync_tree(root: pathlib.Path) -> None:
  """fsyncs every file and directory under `root` (a directory about to be renamed into place)."""
  for folder, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(folder, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fsync_directory(folder)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes a file so that a crash leaves the old file or the new one, never half of one."""
  write_lines_atomic(path, [text])


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, **kwargs) -> None:
  """`obj` as (indented) JSON, written atomically (reports, manifests, predictions)."""
  write_text_atomic(path, json.dumps(obj, indent=indent, **kwargs))


def read_json(path: str | os.PathLike, error: type[Exception] = DataError, hint: str = ""):
  """A JSON file's contents; an unreadable or damaged one (a disk fault, a hand edit) is
  `error` naming the file, the cause and `hint` (what to do about it)."""
  try:
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise error(f"{path}: unreadable ({type(e).__name__}: {e})" + (f"; {hint}" if hint else "")
                ) from None


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
  """One JSON object per line (UTF-8, non-ASCII kept), written atomically."""
  write_lines_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_bytes_atomic(path: str | os.PathLike, data) -> None:
  """`data` (bytes, or a uint8 array: a serialized faiss index) written atomically."""
  _write_atomic(path, lambda f: f.write(memoryview(data)))


def save_npy_atomic(path: str | os.PathLike, array: np.ndarray) -> None:
  _write_atomic(path, lambda f: np.save(f, array), ".npy")


def save_npz_atomic(path: str | os.PathLike, **arrays: np.ndarray) -> None:
  """`np.savez` written atomically (a kill leaves the old file or the new one)."""
  _write_atomic(path, lambda f: np.savez(f, **arrays), ".npz")


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
  """Puts a complete directory `tmp` in the place of `final` (replacing an older one), its
  contents on disk before the rename, the rename on disk after it."""
  fsync_tree(pathlib.Path(tmp))
  remove(pathlib.Path(final))
  os.replace(tmp, final)
  fsync_directory(pathlib.Path(final).absolute().parent)


def digest_texts(*texts: str, length: int = 16) -> str:
  """A short sha256 of strings (each length-prefixed, so the parts cannot run into each other)."""
  h = hashlib.sha256()
  for text in texts:
    data = text.encode("utf-8", "surrogatepass")
    h.update(len(data).to_bytes(8, "little") + data)
  return h.hexdigest()[:length]


def file_digest(path: str | os.PathLike, length: int = 16) -> str:
  """A short sha256 of a file's bytes (read in 1 MiB blocks)."""
  h = hashlib.sha256()
  try:
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
  except OSError as e:
    raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
  return h.hexdigest()[:length]


def digest(*arrays, length: int = 16) -> str:
  """A short sha256 of arrays' bytes (parameter and data fingerprints)."""
  h = hashlib.sha256()
  for array in arrays:
    h.update(np.ascontiguousarray(array).tobytes())
  return h.hexdigest()[:length]


def file_checksum(path: str | os.PathLike) -> dict:
  """{"bytes": size, "crc32": hex} of a file a later run reads, recorded when it is written.
  CRC-32 (zlib) because it is the fastest whole-file check the standard library has (several
  times blake2b's or sha256's speed: results/integrity.md) and it catches any damaged run of
  bytes up to 32 bits and other damage but once in 2^32; it guards against faults, not against
  deliberate tampering."""
  crc, size = 0, 0
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      crc, size = zlib.crc32(block, crc), size + len(block)
  return {"bytes": size, "crc32": f"{crc:08x}"}


def folder_checksums(folder: str | os.PathLike, skip: Iterable[str] = ()) -> dict[str, dict]:
  """`file_checksum` of every file under `folder` but `skip` and verified stamps (`STAMP`), by
  path relative to it."""
  folder, skip = pathlib.Path(folder), set(skip)
  return {path.relative_to(folder).as_posix(): file_checksum(path)
          for path in sorted(folder.rglob("*"))
          if path.is_file() and path.name != STAMP
          and path.relative_to(folder).as_posix() not in skip}


# A folder's verified stamp: for each file whose contents a check found equal to the recorded
# digest, that digest and the file's size, mtime, ctime and inode then. A later check of a file
# with all of them unchanged skips reading it; a write in place, a copy or a replacement changes
# one of them, so that file is read again.
STAMP = ".dpjax_verified.json"
# Files changed less than this before a check are not stamped: a write in the same tick of a
# coarse file system clock (or a skewed network one) could leave their times as they were.
STAMP_SETTLE_NS = 2_000_000_000


def checksum_problems(folder: str | os.PathLike, recorded: dict[str, dict], *,
                      contents: bool, reuse_stamps: bool = True) -> list[str]:
  """What is wrong with the files `recorded` (`folder_checksums`) under `folder`, one
  "<path>: <what>" each: missing or of another size (always checked: a stat), or with
  `contents` other bytes than when they were written (a read of every byte).

  With `contents`, the files found intact are stamped in the folder's `STAMP`; with
  `reuse_stamps` a file whose stamp still matches its recorded digest and its stat is not read
  again (`run.py verify` reads every byte: a disk fault that keeps the times shows there).
  """
  folder = pathlib.Path(folder)
  stamp = _read_stamp(folder) if contents else {}
  fresh = dict(stamp)  # the stamp after this check (entries of files not checked here kept)
  problems = []
  for name, record in recorded.items():
    path = folder / name
    fresh.pop(name, None)  # stamped again below only if found intact now
    try:
      stat = path.stat()
      if stat.st_size != record["bytes"]:
        problems.append(f"{path}: {stat.st_size} bytes, {record['bytes']} when it was written")
      elif contents:
        entry = _stamp_entry(stat, record)
        if reuse_stamps and stamp.get(name) == entry:
          fresh[name] = entry
          continue
        started = time.time_ns()
        if file_checksum(path)["crc32"] != record["crc32"]:
          problems.append(f"{path}: its bytes differ from when it was written (crc32)")
        elif max(stat.st_mtime_ns, stat.st_ctime_ns) < started - STAMP_SETTLE_NS:
          fresh[name] = entry
    except OSError as e:
      problems.append(f"{path}: {os.strerror(e.errno) if e.errno else e}")
  if contents and fresh != stamp:
    _write_stamp(folder, fresh)
  return problems


def _stamp_entry(stat: os.stat_result, record: dict) -> dict:
  return {"bytes": record["bytes"], "crc32": record["crc32"], "mtime_ns": stat.st_mtime_ns,
          "ctime_ns": stat.st_ctime_ns, "inode": stat.st_ino}


def _read_stamp(folder: pathlib.Path) -> dict[str, dict]:
  """The folder's stamp entries by file name; a missing, unreadable or damaged stamp is none
  (its files are read again), never an error."""
  try:
    stamp = json.loads((folder / STAMP).read_text(encoding="utf-8"))
    files = stamp["files"] if stamp.get("version") == 1 else {}
    return {name: entry for name, entry in files.items() if isinstance(entry, dict)}
  except FileNotFoundError:
    return {}
  except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
    log.info("%s: ignored (%s: %s); its files are read again", folder / STAMP,
             type(e).__name__, e)
    return {}


def _write_stamp(folder: pathlib.Path, files: dict[str, dict]) -> None:
  """Writes the folder's stamp; one that cannot be written (a read-only or full disk) only
  costs the next check its reads."""
  try:
    write_json(folder / STAMP, {"version": 1, "files": files}, indent=None, sort_keys=True)
  except OSError as e:
    log.info("%s: not written (%s); the next check reads the files again", folder / STAMP,
             os.strerror(e.errno) if e.errno else e)


def refuse_damage(problems: list[str] | None, error: type[Exception], what: str,
                  rerun: str) -> None:
  """Raises `error` naming the first of `problems` (`checksum_problems`), if any: "<file>: <what
  is wrong>: the <what> is damaged; <rerun>" (checkpoints, dump shards and indexes alike)."""
  if problems:
    raise error(f"{problems[0]}: the {what} is damaged; {rerun}")


@contextlib.contextmanager
def workdir_lock(path: str | os.PathLike, what: str = "training", command: str | None = None):
  """Holds the lock file `path` (e.g. `<workdir>/train.lock`) for one run: a second run of the
  same kind in the workdir would delete the first one's checkpoints and interleave its metrics
  (a BusyError naming the holder's pid and command line: `command`, by default this process's).
  A lock whose process is gone (a killed run on this host) is taken over; one of another host is
  never (its process cannot be checked from here). The lock file is created with its pid, host
  and command in it at once (hard link of a written file), so no reader sees it empty.
  Taking and releasing run under an flock of the lock's directory: two runs that both find a
  dead run's lock cannot both take it over (each read, unlink and link is one step for the
  others), and a run releases only its own lock."""
  path = pathlib.Path(path)
  me = (os.getpid(), socket.gethostname())
  command = " ".join((command or shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
                      ).split())  # one line, whatever the arguments hold
  with _directory_flock(path.parent):
    pid, host = _lock_holder(path)
    holder = _lock_command(path) if pid is not None else ""
    held_by = f": {holder}" if holder else ""
    if pid is not None and (host not in (None, me[1]) or (pid and _process_alive(pid))):
      where = "" if host in (None, me[1]) else f" on host {host}"
      raise BusyError(f"{path}: another {what + ' ' if what else ''}run (pid {pid}{where}"
                      f"{held_by}) is using this workdir; wait for it, or run in a second "
                      "workdir" + (f" (if that run is gone, delete {path})" if where else ""))
    if pid is not None:
      log.warning("%s: taking over the lock of a run that is gone (pid %s%s)", path, pid or "?",
                  held_by)
      path.unlink(missing_ok=True)
    tmp = _temporary(path)
    tmp.write_text(f"{me[0]} {me[1]} {command}")
    try:
      os.link(tmp, path)
    except FileExistsError:
      raise BusyError(f"{path}: could not take the lock (another {what + ' ' if what else ''}run "
                      "took it)") from None
    finally:
      tmp.unlink(missing_ok=True)
  try:
    yield
  finally:
    with _directory_flock(path.parent):
      if _lock_holder(path) == me:  # (a lock deleted by hand and taken by another run: kept)
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _directory_flock(directory: pathlib.Path):
  """An exclusive flock of `directory` (held by one process at a time; released if it dies). On a
  file system without flocks (some network ones) the lock goes on without it, as before."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
        raise
      log.warning("%s: no flock on this file system (%s); two runs starting at once could both "
                  "take a dead run's lock", directory, e.strerror)
    yield
  finally:
    os.close(fd)  # releases the flock


def _lock_holder(path: pathlib.Path) -> tuple[int | None, str | None]:
  """(pid, host) in a lock file: pid 0 if unreadable, host None if not recorded (a lock of an
  older dpjax); (None, None) when there is no lock."""
  try:
    fields = path.read_text().split()
  except FileNotFoundError:
    return None, None
  except OSError:
    return 0, None
  try:
    return int(fields[0]) if fields else 0, (fields[1] if len(fields) > 1 else None)
  except ValueError:
    return 0, None


def _lock_command(path: pathlib.Path) -> str:
  """The command line a lock file records after its pid and host ("" if none)."""
  try:
    return " ".join(path.read_text().split()[2:])
  except OSError:
    return ""


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
