"""faiss indexes over a dump's token vectors (inner product).

`spec` is a faiss factory string: `Flat` (exact), `IVF<nlist>,SQ4` / `IVF<nlist>,SQ8`, or
`OPQ<m>,IVF<nlist>,PQ<m>x<bits>`; `IVFauto` picks nlist ~ 4 sqrt(N). On small corpora nlist is
clamped to N / 39 (faiss's minimum training points per centroid) and PQ bits to log2(N), with a
log line saying so, instead of failing. A token-filter threshold drops tokens whose start and end
filter logits are both below it. The index is written with `kept_tokens.npy` (faiss row -> token
id in the dump) and a manifest (spec, counts, nprobe, the dump's fingerprint) into
`<dump>/indexes/<name>/`, via a temporary directory renamed when complete.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import re
import shutil
import time

import faiss
import numpy as np

from dpjax.index.dump import Dump, DumpError

log = logging.getLogger(__name__)
MANIFEST = "index_manifest.json"


def resolve_spec(spec: str, num_vectors: int, train_size: int) -> tuple[str, list[str]]:
  """Clamps nlist / PQ bits of a factory string to what `train_size` vectors can train."""
  notes = []
  n_train = min(num_vectors, train_size)
  match = re.search(r"IVF(\d+|auto)", spec)
  if match:
    wanted = (int(4 * math.sqrt(num_vectors)) if match.group(1) == "auto"
              else int(match.group(1)))
    nlist = max(1, min(wanted, n_train // 39))
    if match.group(1) != "auto" and nlist != wanted:
      notes.append(f"nlist {wanted} clamped to {nlist}: {n_train} training vectors allow at "
                   "most 1 centroid per 39")
    spec = spec.replace(match.group(0), f"IVF{nlist}")
  match = re.search(r"PQ(\d+)x(\d+)", spec)
  if match:
    bits = int(match.group(2))
    allowed = max(1, min(bits, int(math.log2(max(n_train, 2)))))
    if allowed != bits:
      notes.append(f"PQ bits {bits} clamped to {allowed}: {n_train} training vectors")
      spec = spec.replace(match.group(0), f"PQ{match.group(1)}x{allowed}")
  return spec, notes


def _use_gpu() -> bool:
  return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def build_index(dump_dir: str | os.PathLike, spec: str = "Flat", *, name: str | None = None,
                filter_threshold: float | None = None, train_size: int = 1_000_000,
                nprobe: int = 256, seed: int = 0) -> pathlib.Path:
  """Builds and writes a faiss index over a complete dump; returns the index directory."""
  dump = Dump.load(dump_dir)
  vectors = dump.vectors
  kept = np.arange(len(vectors), dtype=np.int64)
  if filter_threshold is not None:
    kept = np.flatnonzero(dump.filter_logits.astype(np.float32).max(1) >= filter_threshold)
    log.info("filter threshold %.3f keeps %d of %d tokens (%.1f%%)", filter_threshold, len(kept),
             len(vectors), 100 * len(kept) / max(len(vectors), 1))
  if not len(kept):
    raise DumpError(f"{dump_dir}: no token passes the filter threshold {filter_threshold}")
  resolved, notes = resolve_spec(spec, len(kept), train_size)
  for note in notes:
    log.warning("%s", note)
  dim = vectors.shape[1]
  start = time.perf_counter()
  index = (faiss.IndexFlatIP(dim) if resolved == "Flat"
           else faiss.index_factory(dim, resolved, faiss.METRIC_INNER_PRODUCT))
  if _use_gpu():
    index = faiss.index_cpu_to_all_gpus(index)
  if not index.is_trained:
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(kept, size=min(train_size, len(kept)), replace=False))
    index.train(vectors[sample].astype(np.float32))
  for lo in range(0, len(kept), 1 << 18):  # bounded float32 copies
    index.add(vectors[kept[lo:lo + (1 << 18)]].astype(np.float32))
  if _use_gpu():
    index = faiss.index_gpu_to_cpu(index)
  seconds = time.perf_counter() - start
  name = name or re.sub(r"[^A-Za-z0-9_.-]+", "_", spec) + (
      f"_filter{filter_threshold:g}" if filter_threshold is not None else "")
  final = pathlib.Path(dump_dir) / "indexes" / name
  tmp = final.with_name(final.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  faiss.write_index(index, str(tmp / "index.faiss"))
  np.save(tmp / "kept_tokens.npy", kept)
  manifest = {"spec": spec, "resolved_spec": resolved, "notes": notes,
              "num_tokens": int(len(kept)), "dump_tokens": int(len(vectors)),
              "filter_threshold": filter_threshold, "nprobe": nprobe,
              "fingerprint": dump.manifest["fingerprint"], "build_seconds": seconds,
              "index_bytes": (tmp / "index.faiss").stat().st_size}
  (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
  if final.exists():
    shutil.rmtree(final)
  os.replace(tmp, final)
  log.info("index %s: %d vectors, %s, %.1f s, %.1f bytes/token", final, len(kept), resolved,
           seconds, manifest["index_bytes"] / len(kept))
  return final
