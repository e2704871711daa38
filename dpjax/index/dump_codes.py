"""A dump that keeps only some tokens or codes them (`index.dump_filter_threshold`,
`index.dump_codec`, `index.dump_vectors`): `dump_kept` encodes its shards in memory one at a
time, drops the tokens the filter head does not keep and writes the others' codes (and, when
asked, float16 vectors), so that neither the disk nor an index ever holds the dropped tokens or
a shard's full vectors.

The codec (`codec.faiss` in the dump's folder, its digest in the manifest) is trained before any
shard is written, on `train_size` kept tokens drawn (seeded, as `faiss_index` draws an index's
training sample) from the kept tokens of the dump's first shards, encoded until that many are
kept or the corpus ends; those shards are then written from memory, not encoded again. A rerun
reuses the codec and resumes by shard.

A shard of this layout (`"layout": "kept"` in its info) holds, for its K kept tokens:

  codes.npy           [K, C] uint8    the codec's codes (with a codec)
  vectors.npy         [K, D] float16  (only with index.dump_vectors)
  filter_logits.npy   [K, 2] float16  start/end filter logits
  char_spans.npy      [K, 2] uint16   (int32 where a passage is longer) characters of each token
  positions.npy       [K]    uint16   (int32 likewise) each token's place among its passage's
                                      encoded tokens: phrase lengths count the passage's tokens
  passage_tokens.npy  [P, 2] int32    each passage's kept and encoded tokens

and passages.jsonl and shard.json as every shard (`tokens`: K; `context_tokens`: the encoded
ones). Token ids of such a dump count the encoded tokens (`context_token_ids`), so that a compact
index over it is the one index-time filtering of the unfiltered dump makes.
"""
from __future__ import annotations

import logging
import pathlib
import shutil

import faiss
import numpy as np

from dpjax import distributed
from dpjax.errors import ConfigError, DumpError
from dpjax.index import compact
from dpjax.index.encode import encode_pipelined, encode_shard, timed_result
from dpjax.index.faiss_index import resolve_spec
from dpjax.index.manifest import DUMP_CODEC as CODEC, DumpConfig, write_manifest
from dpjax.index.shards import shard_name, write_shard
from dpjax.io import Progress, file_digest

log = logging.getLogger(__name__)
# Room kept free beside a shard's estimated bytes (its info, the manifest, the file system's).
DISK_MARGIN = 1 << 20


def is_kept_layout(config: DumpConfig) -> bool:
  """Whether a dump of `config` filters or codes its tokens (this module's layout)."""
  return config.filter_threshold is not None or bool(config.codec) or not config.vectors


def write_shards(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
                 progress: Progress, timings: dict, maker, made: dict, pipeline: list,
                 manifest: dict, dim: int) -> None:
  """The shards `todo` encoded and written: their kept tokens (`dump_kept`) when the dump
  filters or codes them, else every token's `dim`-d vector, batch by batch
  (`encode_pipelined`)."""
  if is_kept_layout(config):
    dump_kept(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker, made,
              pipeline, manifest)
  else:
    encode_pipelined(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker,
                     made, pipeline, dim)


def dump_kept(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
              progress: Progress, timings: dict, maker, made: dict, pipeline: list,
              manifest: dict) -> None:
  """Encodes, filters, codes and writes the shards `todo` ((number, passages)), one at a time
  (`encode_pipelined`'s arguments); trains the codec first (or reuses the dump's). `manifest`:
  the dump's, given the codec's record. `made`: shard number -> its windows made ahead."""
  codec = _existing_codec(out_dir, manifest, config)
  pending: list[tuple[int, list, dict]] = []  # shards encoded for the codec's sample
  todo = iter(todo)
  job = next(todo, None)
  ahead = None if job is None else made.pop(job[0], None) or maker.submit(job[1])
  while job is not None:
    number, chunk = job
    windows = ahead if isinstance(ahead, list) else timed_result(ahead, pipeline)
    job = next(todo, None)  # the next shard tokenized while this one is encoded
    ahead = None if job is None else made.pop(job[0], None) or maker.submit(job[1])
    arrays = kept_arrays(encode_shard(tokenizer, chunk, config, mesh, encode, progress,
                                      windows=windows, timings=timings, pipeline=pipeline),
                         config.filter_threshold)
    if codec is None and config.codec:
      pending.append((number, chunk, arrays))
      if sum(len(a["filter_logits"]) for *_, a in pending) < config.train_size and job:
        continue
      codec = _train_codec(out_dir, manifest, config, [a for *_, a in pending])
    for waiting in pending or [(number, chunk, arrays)]:
      write_kept_shard(out_dir, *waiting, codec, config)
    pending = []
  if codec is None and config.codec and not (out_dir / CODEC).is_file():
    raise DumpError(f"{out_dir}: no shard left to encode, but no {CODEC}: delete the dump "
                    "and run it again")


def kept_arrays(arrays: dict[str, np.ndarray], threshold: float | None) -> dict[str, np.ndarray]:
  """A shard's encoded arrays (`encode_shard`'s, every context token) cut to the tokens the
  filter keeps (logits max >= `threshold`; None: all), with each one's position in its passage
  and each passage's kept and encoded tokens."""
  token_passage = arrays["token_passage"]
  passages = int(token_passage.max(initial=-1)) + 1
  encoded = np.bincount(token_passage, minlength=passages)
  first = np.concatenate([[0], np.cumsum(encoded)[:-1]]).astype(np.int64)
  positions = np.arange(len(token_passage)) - first[token_passage]
  keep = (np.ones(len(token_passage), bool) if threshold is None else
          arrays["filter_logits"].astype(np.float32).max(1) >= threshold)
  return {"vectors": arrays["vectors"][keep], "filter_logits": arrays["filter_logits"][keep],
          "char_spans": arrays["char_spans"][keep], "positions": positions[keep],
          "token_passage": token_passage[keep], "encoded": encoded}


def write_kept_shard(out_dir: pathlib.Path, number: int, chunk: list, arrays: dict, codec,
                     config: DumpConfig) -> dict:
  """Writes one shard of kept tokens (the module's layout) atomically, once the disk is seen
  to hold it; returns its info."""
  kept = len(arrays["filter_logits"])
  counts = np.stack([np.bincount(arrays["token_passage"], minlength=len(chunk)),
                     np.pad(arrays["encoded"], (0, len(chunk) - len(arrays["encoded"])))], 1)
  last = max(int(arrays["char_spans"].max(initial=0)), int(arrays["positions"].max(initial=0)))
  files = {"filter_logits": arrays["filter_logits"],
           "char_spans": arrays["char_spans"].astype(compact.span_dtype(last)),
           "positions": arrays["positions"].astype(compact.span_dtype(last)),
           "passage_tokens": counts.astype(np.int32)}
  if codec is not None:
    files["codes"] = encode_codes(codec, arrays["vectors"])
  if config.vectors:
    files["vectors"] = arrays["vectors"]
  _check_disk(out_dir, number, files, chunk)
  return write_shard(out_dir, shard_name(number), files, chunk,
                     {"layout": "kept", "context_tokens": int(counts[:, 1].sum())}, tokens=kept)


def encode_codes(codec, vectors: np.ndarray) -> np.ndarray:
  """[K, C] uint8 codes of float16 vectors [K, D] (bounded float32 copies)."""
  codes = np.empty((len(vectors), compact.flat_codes(codec).code_size), np.uint8)
  for lo in range(0, len(vectors), 1 << 16):
    codes[lo:lo + (1 << 16)] = codec.sa_encode(np.asarray(vectors[lo:lo + (1 << 16)],
                                                          np.float32))
  return codes


def _check_disk(out_dir: pathlib.Path, number: int, files: dict, chunk: list) -> None:
  """Refuses to begin a shard the disk cannot hold (its arrays, its passages' text, a margin)."""
  need = (sum(a.nbytes + 128 for a in files.values()) + DISK_MARGIN
          + sum(len(p.text) + len(p.title) + len(str(p.id)) + 40 for p in chunk))
  free = shutil.disk_usage(out_dir).free
  if free < need:
    raise DumpError(f"{out_dir / shard_name(number)}: {free / 2**20:.1f} MiB free, the shard "
                    f"needs about {need / 2**20:.1f} MiB; free space and run the dump again "
                    "(it resumes)")


def _existing_codec(out_dir: pathlib.Path, manifest: dict, config: DumpConfig):
  """The dump's trained codec when a run made it (its digest checked), else None."""
  path = out_dir / CODEC
  if not config.codec or not path.is_file():
    return None
  record = manifest.get("codec")
  if record is None:  # a run killed between writing it and recording it: trained again
    return None
  if record.get("sha") != file_digest(path):
    raise DumpError(f"{path} is not the codec this dump's manifest records: delete the dump's "
                    "directory and dump again")
  return faiss.read_index(str(path))


def _train_codec(out_dir: pathlib.Path, manifest: dict, config: DumpConfig,
                 shards: list[dict]):
  """The codec trained on a seeded sample of `shards`' kept tokens, written (atomically) with
  its record in the manifest; refused with one line when no token is kept or it cannot train."""
  total = sum(len(a["vectors"]) for a in shards)
  if not total:
    raise DumpError(f"{out_dir}: index.dump_filter_threshold {config.filter_threshold} keeps "
                    "none of the tokens encoded for the codec's training sample: lower it")
  size = min(config.train_size, total)
  resolved, notes = resolve_spec(config.codec, total, config.train_size)
  for note in notes:
    log.warning("dump codec: %s", note)
  try:
    codec = faiss.index_factory(int(shards[0]["vectors"].shape[1]), resolved,
                                faiss.METRIC_INNER_PRODUCT)
  except RuntimeError as e:
    raise ConfigError(f"index.dump_codec: {resolved!r} is not a faiss factory string "
                      f"({_first_line(e)})") from None
  compact.flat_codes(codec)
  # (drawn as `faiss_index` draws an index's sample, gathered shard by shard: no joined copy)
  picks = np.sort(np.random.default_rng(0).choice(total, size=size, replace=False))
  bounds = np.cumsum([0] + [len(a["vectors"]) for a in shards])
  vectors = np.concatenate([a["vectors"][picks[(picks >= lo) & (picks < hi)] - lo]
                            for a, lo, hi in zip(shards, bounds, bounds[1:])]).astype(np.float32)
  try:
    codec.train(vectors)
  except RuntimeError as e:
    raise ConfigError(f"index.dump_codec: {resolved!r} cannot be trained on {size} tokens "
                      f"({_first_line(e)}); raise index.train_size or choose fewer code bits"
                      ) from None
  tmp = out_dir / (CODEC + ".tmp")
  faiss.write_index(codec, str(tmp))
  tmp.replace(out_dir / CODEC)
  manifest["codec"] = {"spec": resolved, "sha": file_digest(out_dir / CODEC),
                       "code_size": int(compact.flat_codes(codec).code_size),
                       "train_tokens": int(size), "notes": notes}
  if distributed.is_main():
    write_manifest(out_dir, manifest)
  log.info("dump codec %s trained on %d kept tokens", resolved, size)
  return codec


def _first_line(error: RuntimeError) -> str:
  return next((line for line in str(error).splitlines() if "rror" in line),
              str(error)[:200]).strip()
