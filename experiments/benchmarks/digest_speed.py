"""Seconds per GiB of the file digests dpjax records (`dpjax.io.file_checksum`) against other
stdlib hashes, over a 256 MiB buffer in memory (a file in the page cache; a disk adds its reads);
then what checking a real file of `--file-gib` GiB costs at a load: `dpjax.io.checksum_problems`
read from the disk (the file dropped from the page cache first), from the page cache, and once
its verified stamp is written (a stat and a small JSON read, whatever the file's size).

  python experiments/benchmarks/digest_speed.py --file-gib 1
  python experiments/benchmarks/digest_speed.py --file-gib 0   # the in-memory hashes only
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import tempfile
import time
import zlib

from dpjax import io

SIZE = 256 << 20
BLOCK = 1 << 20  # as `file_checksum` reads


def crc32(data: memoryview) -> None:
  value = 0
  for at in range(0, len(data), BLOCK):
    value = zlib.crc32(data[at:at + BLOCK], value)


def hasher(name: str):
  def run(data: memoryview) -> None:
    h = hashlib.new(name)
    for at in range(0, len(data), BLOCK):
      h.update(data[at:at + BLOCK])
    h.digest()
  return run


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--file-gib", type=float, default=1.0,
                      help="size of the temporary file checked at a load (0: none)")
  parser.add_argument("--dir", help="where the temporary file goes (default: $TMPDIR)")
  args = parser.parse_args(argv)
  data = memoryview(os.urandom(SIZE))
  for name, fn in (("zlib.crc32", crc32), ("blake2b", hasher("blake2b")),
                   ("sha256", hasher("sha256")), ("md5", hasher("md5"))):
    best = min(_timed(fn, data) for _ in range(3))
    print(f"{name:<11} {best * (1 << 30) / SIZE:.3f} s/GiB ({SIZE / best / (1 << 30):.2f} GiB/s)")
  if args.file_gib > 0:
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
      _file_check(pathlib.Path(folder), int(args.file_gib * (1 << 30)), data)


def _file_check(folder: pathlib.Path, size: int, data: memoryview) -> None:
  """Prints the seconds per GiB of checking a `size`-byte file's contents at a load."""
  path = folder / "artifact.bin"
  with path.open("wb") as f:
    for at in range(0, size, len(data)):
      f.write(data[:min(len(data), size - at)])
    f.flush()
    os.fsync(f.fileno())
  recorded = {path.name: io.file_checksum(path)}
  gib = size / (1 << 30)
  io.STAMP_SETTLE_NS = 0  # the file was just written; stamp it at the first check
  for what in ("from disk", "from the page cache", "with its stamp"):
    if what == "from disk":
      _drop_from_page_cache(path)
    if what != "with its stamp":  # (each check stamps the file: the next one then skips it)
      (folder / io.STAMP).unlink(missing_ok=True)
    seconds = _timed(lambda _: io.checksum_problems(folder, recorded, contents=True), None)
    print(f"checking {gib:g} GiB {what:<19} {seconds / gib:.4f} s/GiB")


def _drop_from_page_cache(path: pathlib.Path) -> None:
  """Asks the kernel to forget the file's cached pages (written and fsynced: clean), so the next
  read comes from the disk; needs no privileges."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def _timed(fn, data) -> float:
  start = time.perf_counter()
  fn(data)
  return time.perf_counter() - start


if __name__ == "__main__":
  main()
