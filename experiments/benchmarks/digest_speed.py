"""Seconds per GiB of the file digests dpjax records (`dpjax.io.file_checksum`) against other
stdlib hashes, over a 256 MiB buffer in memory (a file in the page cache; a disk adds its reads).

  python experiments/benchmarks/digest_speed.py
"""
from __future__ import annotations

import hashlib
import os
import time
import zlib

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


def main() -> None:
  data = memoryview(os.urandom(SIZE))
  for name, fn in (("zlib.crc32", crc32), ("blake2b", hasher("blake2b")),
                   ("sha256", hasher("sha256")), ("md5", hasher("md5"))):
    best = min(_timed(fn, data) for _ in range(3))
    print(f"{name:<11} {best * (1 << 30) / SIZE:.3f} s/GiB ({SIZE / best / (1 << 30):.2f} GiB/s)")


def _timed(fn, data) -> float:
  start = time.perf_counter()
  fn(data)
  return time.perf_counter() - start


if __name__ == "__main__":
  main()
