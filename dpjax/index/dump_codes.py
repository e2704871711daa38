"""A dump that keeps only some tokens or codes them (`index.dump_filter_threshold`,
`index.dump_codec`, `index.dump_vectors`): `dump_kept` encodes its shards one at a time and, as
each batch of the encoder's outputs comes (`KeptTokens`), drops the tokens the filter head does
not keep and codes the others, so that neither memory, the disk nor an index ever holds the
dropped tokens or a shard's full vectors; it writes the kept tokens' codes (and, when asked,
float16 vectors).

The codec (`codec.faiss` in the dump's folder, its digest in the manifest) is trained before any
shard is encoded, on `train_size` kept tokens of a sample of passages drawn across the whole
corpus (`codec_sample`): every passage gets a seeded random key by its place in the corpus, and a
read of the corpus takes the passages of the smallest keys whose texts hold about the characters
`train_size` tokens need; they are encoded and filtered, and when the filter keeps too few, a
further read takes the next keys, sized by the tokens kept per character so far. `train_size` of
the sample's kept tokens (all when fewer), drawn seeded as `faiss_index` draws an index's
training sample and taken in corpus order, train the codec. The sample costs one read of the
corpus (more when a filter keeps few tokens) and its passages' encoding: they are encoded again
in their shards, so a corpus smaller than the sample is encoded twice. No shard waits for the
codec, so memory holds one shard's kept tokens (and, while the codec trains, its sample),
whatever the corpus's size. A rerun reuses the codec (the sample is not drawn again) and resumes
by shard.

A shard of this layout (`"layout": "kept"` in its info) holds, for its K kept tokens:

  codes.npy           [K, C] uint8    the codec's codes (with a codec)
  vectors.npy         [K, D] float16  (only with index.dump_vectors)
  filter_logits.npy   [K, 2] float16  start/end filter logits
  char_spans.npy      [K, 2] uint16   (int32 where a passage is longer) characters of each token
  positions.npy       [K]    uint16   (int32 likewise) each token's place among its passage's
                                      encoded tokens: phrase lengths count the passage's tokens
  passage_tokens.npy  [P, 2] int32    each passage's kept and encoded tokens

and passages.jsonl and shard.json as every shard (`tokens`: K; `context_tokens`: the encoded
ones; `windows`, `encoded_tokens`: the windows encoded and their real tokens). Token ids of such a dump count the encoded tokens (`context_token_ids`), so that a compact
index over it is the one index-time filtering of the unfiltered dump makes.
"""
from __future__ import annotations

import heapq
import logging
import pathlib
import shutil
from typing import Iterable

import faiss
import numpy as np

from dpjax import distributed
from dpjax.data.squad import Passage
from dpjax.errors import ConfigError, DumpError
from dpjax.index import compact
from dpjax.index.encode import encode_pipelined, encode_shard, timed_result
from dpjax.index.faiss_index import resolve_spec
from dpjax.index.manifest import DUMP_CODEC as CODEC, DumpConfig, write_manifest
from dpjax.index.shards import shard_name, write_shard
from dpjax.index.window_maker import kept_slices
from dpjax.io import Progress, file_digest

log = logging.getLogger(__name__)
# Room kept free beside a shard's estimated bytes (its info, the manifest, the file system's).
DISK_MARGIN = 1 << 20
# The characters of text the codec's first read of the corpus takes per training token: about
# a word-piece token's, so that a dump keeping every token reads the corpus once.
SAMPLE_CHARS_PER_TOKEN = 6


def is_kept_layout(config: DumpConfig) -> bool:
  """Whether a dump of `config` filters or codes its tokens (this module's layout)."""
  return config.filter_threshold is not None or bool(config.codec) or not config.vectors


def write_shards(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
                 progress: Progress, timings: dict, maker, made: dict, pipeline: list,
                 manifest: dict, dim: int, corpus: Iterable[Passage]) -> None:
  """The shards `todo` encoded and written: their kept tokens (`dump_kept`) when the dump
  filters or codes them, else every token's `dim`-d vector, batch by batch
  (`encode_pipelined`). `corpus`: the dump's passages, read again for the codec's sample."""
  if is_kept_layout(config):
    dump_kept(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker, made,
              pipeline, manifest, corpus)
  else:
    encode_pipelined(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker,
                     made, pipeline, dim)


def dump_kept(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
              progress: Progress, timings: dict, maker, made: dict, pipeline: list,
              manifest: dict, corpus: Iterable[Passage]) -> None:
  """Encodes, filters, codes and writes the shards `todo` ((number, passages)), one at a time
  (`encode_pipelined`'s arguments); trains the codec first on a sample of `corpus`
  (`codec_sample`), or reuses the dump's. `manifest`: the dump's, given the codec's record.
  `made`: shard number -> its windows made ahead."""
  codec = _existing_codec(out_dir, manifest, config)
  todo = iter(todo)
  job = next(todo, None)
  if codec is None and config.codec:
    if job is None and not (out_dir / CODEC).is_file():
      raise DumpError(f"{out_dir}: no shard left to encode, but no {CODEC}: delete the dump "
                      "and run it again")
    if job is not None:
      codec = _train_codec(out_dir, manifest, config,
                           *codec_sample(corpus, tokenizer, config, mesh, encode))
  ahead = None if job is None else made.pop(job[0], None) or maker.submit(job[1])
  while job is not None:
    number, chunk = job
    windows = ahead if isinstance(ahead, list) else timed_result(ahead, pipeline)
    job = next(todo, None)  # the next shard tokenized while this one is encoded
    ahead = None if job is None else made.pop(job[0], None) or maker.submit(job[1])
    tokens = KeptTokens(config.filter_threshold, codec, vectors=config.vectors)
    encode_shard(tokenizer, chunk, config, mesh, encode, progress, windows=windows,
                 timings=timings, stream=lambda: tokens, pipeline=pipeline)
    write_kept_shard(out_dir, number, chunk, tokens.arrays(), config)


class KeptTokens:
  """One shard's encoder outputs taken batch by batch (`encode_shard`'s stream): of the tokens
  the filter keeps (logits max >= `threshold`; None: all), their filter logits, their codes
  (with a `codec`) and, when asked (`vectors`), their float16 vectors, each with its row among
  the shard's encoded tokens; the others are dropped as they come, so that no array of the
  shard's vectors is ever held. `arrays()` gives them in passage order once the shard is
  encoded."""

  def __init__(self, threshold: float | None, codec=None, *, vectors: bool):
    self.threshold, self.codec, self.keep_vectors = threshold, codec, vectors
    self.parts: dict[str, list[np.ndarray]] = {"rows": [], "filter_logits": [], "codes": [],
                                               "vectors": []}
    self.shard_tables: dict[str, np.ndarray] | None = None
    self.windows: dict = {}
    self.dim = 0

  def add(self, runs: dict, rows: np.ndarray, vectors: np.ndarray, logits: np.ndarray) -> None:
    """Takes the kept tokens (`runs`, `kept_runs`') of a batch of windows (`rows`; outputs
    [B, width, ...])."""
    slices = np.array(list(kept_slices(runs, rows, vectors.shape[1])), np.int64).reshape(-1, 4)
    batch_row, column, length, destination = slices.T
    step = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
    batch_row, column = np.repeat(batch_row, length), np.repeat(column, length) + step
    token_logits = np.asarray(logits[batch_row, column], np.float16)  # [n, 2]
    keep = (np.ones(len(token_logits), bool) if self.threshold is None else
            token_logits.astype(np.float32).max(1) >= self.threshold)
    kept = np.asarray(vectors[batch_row[keep], column[keep]], np.float16)  # [k, D]
    self.dim = vectors.shape[2]
    self.parts["rows"].append((np.repeat(destination, length) + step)[keep])
    self.parts["filter_logits"].append(token_logits[keep])
    if self.codec is not None and len(kept):
      self.parts["codes"].append(self.codec.sa_encode(kept.astype(np.float32)))
    if self.keep_vectors:
      self.parts["vectors"].append(kept)

  def tables(self, arrays: dict[str, np.ndarray], passages: list, windows: dict) -> None:
    """Takes the shard's token_passage and char_spans (every encoded token) and its windows'
    counts."""
    self.shard_tables, self.windows = arrays, windows

  def arrays(self) -> dict[str, np.ndarray]:
    """The kept tokens' arrays in passage order (`rows` sorted): filter_logits, codes and
    vectors as taken, char_spans, positions (among their passage's encoded tokens) and
    token_passage; `encoded`: each passage's encoded tokens; `windows`: the windows' counts."""
    rows = _joined(self.parts["rows"], (), np.int64)
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    token_passage = self.shard_tables["token_passage"]
    encoded = np.bincount(token_passage, minlength=int(token_passage.max(initial=-1)) + 1)
    first = np.concatenate([[0], np.cumsum(encoded)[:-1]]).astype(np.int64)
    out = {"token_passage": token_passage[rows],
           "char_spans": self.shard_tables["char_spans"][rows],
           "positions": rows - first[token_passage[rows]], "encoded": encoded,
           "windows": self.windows,
           "filter_logits": _joined(self.parts["filter_logits"], (2,), np.float16)[order]}
    if self.codec is not None:
      out["codes"] = _joined(self.parts["codes"], (compact.flat_codes(self.codec).code_size,),
                             np.uint8)[order]
    if self.keep_vectors:
      out["vectors"] = _joined(self.parts["vectors"], (self.dim,), np.float16)[order]
    return out


def _joined(parts: list[np.ndarray], tail: tuple, dtype) -> np.ndarray:
  """`parts` concatenated (an empty [0, *tail] array when there are none)."""
  return np.concatenate(parts) if parts else np.zeros((0, *tail), dtype)


def write_kept_shard(out_dir: pathlib.Path, number: int, chunk: list, arrays: dict,
                     config: DumpConfig) -> dict:
  """Writes one shard of kept tokens (the module's layout; `KeptTokens.arrays()`) atomically,
  once the disk is seen to hold it; returns its info."""
  kept = len(arrays["filter_logits"])
  counts = np.stack([np.bincount(arrays["token_passage"], minlength=len(chunk)),
                     np.pad(arrays["encoded"], (0, len(chunk) - len(arrays["encoded"])))], 1)
  last = max(int(arrays["char_spans"].max(initial=0)), int(arrays["positions"].max(initial=0)))
  files = {"filter_logits": arrays["filter_logits"],
           "char_spans": arrays["char_spans"].astype(compact.span_dtype(last)),
           "positions": arrays["positions"].astype(compact.span_dtype(last)),
           "passage_tokens": counts.astype(np.int32)}
  if "codes" in arrays:
    files["codes"] = arrays["codes"]
  if config.vectors:
    files["vectors"] = arrays["vectors"]
  _check_disk(out_dir, number, files, chunk)
  return write_shard(out_dir, shard_name(number), files, chunk,
                     {"layout": "kept", "context_tokens": int(counts[:, 1].sum()),
                      **arrays["windows"]}, tokens=kept)


def codec_sample(corpus: Iterable[Passage], tokenizer, config: DumpConfig, mesh,
                 encode) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict]:
  """The codec's training sample (the module's docstring): (per chunk of the sample's passages
  encoded, its kept tokens' places in the corpus [K] and float16 vectors [K, D]; a record of the
  sample: passages, corpus shards they fall in, reads of the corpus). Reads `corpus` once or more
  (it must iterate from its start each time: a list, `read_corpus`'s)."""
  if iter(corpus) is corpus:
    raise DumpError("index.dump_codec: the codec's sample reads the corpus before its shards, "
                    "so the dump needs a corpus it can read twice (a list, read_corpus's), not "
                    "a one-pass iterator")
  parts, passages, shards = [], 0, set()
  chars, above, kept, read_chars, reads = config.train_size * SAMPLE_CHARS_PER_TOKEN, 0.0, 0, 0, 0
  while True:
    taken, above, complete = sample_passages(corpus, chars, above)
    reads += 1
    for lo in range(0, len(taken), config.shard_passages):
      chunk = taken[lo:lo + config.shard_passages]
      tokens = KeptTokens(config.filter_threshold, vectors=True)
      encode_shard(tokenizer, [p for _, p in chunk], config, mesh, encode,
                   stream=lambda: tokens)
      arrays = tokens.arrays()
      places = np.array([place for place, _ in chunk], np.int64)
      parts.append((places[arrays["token_passage"]], arrays["vectors"]))
      kept += len(arrays["vectors"])
    passages += len(taken)
    shards.update(place // config.shard_passages for place, _ in taken)
    read_chars += sum(len(p.text) for _, p in taken)
    log.info("dump codec sample: %d passages read (%d kept tokens)", passages, kept)
    if kept >= config.train_size or complete:
      return parts, {"passages": passages, "shards": len(shards), "reads": reads}
    # the next read sized by the kept tokens per character so far (some margin for chance)
    chars = (max(chars * 8, 1) if not kept else
             int((config.train_size - kept) * read_chars / kept * 1.25) + 1)


def sample_passages(corpus: Iterable[Passage], chars: int, above: float = 0.0, seed: int = 0
                    ) -> tuple[list[tuple[int, Passage]], float, bool]:
  """One read of `corpus`: (the passages of the smallest keys above `above` whose texts hold
  `chars` characters (all above it when they hold fewer), as (place, passage) in corpus order;
  the largest key taken (`above` for the next read); whether every passage above `above` was
  taken). Passage i's key is the i-th draw of a seeded uniform generator: the passages of a
  read are a simple random sample of the corpus, and the next read's follow them."""
  heap: list[tuple[float, int, Passage]] = []  # (-key, place, passage): the largest key on top
  held, complete = 0, True
  for place, (passage, key) in enumerate(zip(corpus, _keys(seed))):
    if key <= above:
      continue
    if held >= chars and key > -heap[0][0]:
      complete = False
      continue
    heapq.heappush(heap, (-key, place, passage))
    held += len(passage.text)
    while held - len(heap[0][2].text) >= chars:
      held -= len(heapq.heappop(heap)[2].text)
      complete = False
  taken = sorted(((place, passage) for _, place, passage in heap), key=lambda t: t[0])
  return taken, (-heap[0][0] if heap else above), complete


def _keys(seed: int, block: int = 1 << 14):
  """The uniform draws in [0, 1) of a seeded generator, one by one (drawn in blocks)."""
  rng = np.random.default_rng(seed)
  while True:
    yield from rng.random(block).tolist()


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
                 parts: list[tuple[np.ndarray, np.ndarray]], sample: dict):
  """The codec trained on a seeded draw of `train_size` of the sample's kept tokens (`parts`,
  `codec_sample`'s: each one's place in the corpus and vector; emptied as the draw is
  gathered), written (atomically) with its record (with `sample`'s) in the manifest; refused
  with one line when no token is kept or it cannot train."""
  total = sum(len(places) for places, _ in parts)
  if not total:
    raise DumpError(f"{out_dir}: index.dump_filter_threshold {config.filter_threshold} keeps "
                    "none of the tokens encoded for the codec's training sample: lower it")
  size = min(config.train_size, total)
  resolved, notes = resolve_spec(config.codec, total, config.train_size)
  for note in notes:
    log.warning("dump codec: %s", note)
  try:
    codec = faiss.index_factory(int(parts[0][1].shape[1]), resolved, faiss.METRIC_INNER_PRODUCT)
  except RuntimeError as e:
    raise ConfigError(f"index.dump_codec: {resolved!r} is not a faiss factory string "
                      f"({_first_line(e)})") from None
  compact.flat_codes(codec)
  vectors = _training_vectors(parts, size)
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
                       "train_tokens": int(size), "notes": notes,
                       "sample": {**sample, "kept_tokens": int(total)}}
  if distributed.is_main():
    write_manifest(out_dir, manifest)
  log.info("dump codec %s trained on %d kept tokens of %d passages across %d shards", resolved,
           size, sample["passages"], sample["shards"])
  return codec


def _training_vectors(parts: list[tuple[np.ndarray, np.ndarray]], size: int) -> np.ndarray:
  """[size, D] float32: a seeded draw (as `faiss_index` draws an index's sample) of the kept
  tokens of `parts` ((corpus places [K], float16 vectors [K, D])) taken in corpus order,
  gathered part by part, each part dropped from `parts` once gathered (emptied at the end), so
  that memory holds about one copy of the sample, not the sample and its draw."""
  places = np.concatenate([places for places, _ in parts])
  order = np.argsort(places, kind="stable")  # a passage's tokens stay in order
  picks = np.sort(np.random.default_rng(0).choice(len(places), size=size, replace=False))
  rows = order[picks]
  out = np.empty((size, parts[0][1].shape[1]), np.float32)
  lo = 0
  for number, (_, vectors) in enumerate(parts):
    mine = np.flatnonzero((rows >= lo) & (rows < lo + len(vectors)))
    out[mine] = vectors[rows[mine] - lo]
    lo += len(vectors)
    parts[number] = None
  parts.clear()
  return out


def _first_line(error: RuntimeError) -> str:
  return next((line for line in str(error).splitlines() if "rror" in line),
              str(error)[:200]).strip()
