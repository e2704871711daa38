"""A dump that keeps only some tokens or codes them (`index.dump_filter_threshold`,
`index.dump_codec`, `index.dump_vectors`): `dump_kept` encodes its shards one at a time and, as
each batch of the encoder's outputs comes (`KeptTokens`), drops the tokens the filter head does
not keep and codes the others, so that neither memory, the disk nor an index ever holds the
dropped tokens or a shard's full vectors; it writes the kept tokens' codes (and, when asked,
float16 vectors).

The codec (`codec.faiss` in the dump's folder, its digest in the manifest; a residual codec's
`means_codec.faiss` and `weighting.npy` beside it) is trained before any shard is encoded, on
`train_size` kept tokens of a sample of passages drawn across the whole corpus
(`codec_sample`): every passage gets a seeded random key by its place in the corpus, and a
read of the corpus takes the passages of the smallest keys whose texts hold about the characters
`train_size` tokens need; they are encoded and filtered, and when the filter keeps too few, a
further read takes the next keys, sized by the tokens kept per character so far. `train_size` of
the sample's kept tokens (all when fewer), drawn seeded as `faiss_index` draws an index's
training sample and taken in corpus order, train the codec. The sample costs one read of the
corpus (more when a filter keeps few tokens) and its passages' encoding: they are encoded again
in their shards, so a corpus smaller than the sample is encoded twice. No shard waits for the
codec, so memory holds one shard's kept tokens (and, while the codec trains, its sample),
whatever the corpus's size. A rerun reuses the codec (the sample is not drawn again) and resumes
by shard. A residual codec's sample is sized by `sample_targets` and its codes wait for each
shard's end (`KeptTokens`).

A shard of this layout (`"layout": "kept"` in its info) holds, for its K kept tokens:

  codes.npy           [K, C] uint8    the codec's codes (with a codec)
  passage_means.npy   [P, Cm] uint8   each passage's mean kept vector, coded (a "pr:" codec's:
                                      codes.npy then holds the residuals from it, `residual`)
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
from typing import Callable, Iterable

import faiss
import numpy as np

from dpjax import distributed
from dpjax.data.squad import Passage
from dpjax.errors import ConfigError, DumpError
from dpjax.index import compact, residual
from dpjax.index.encode import encode_pipelined, encode_shard, timed_result
from dpjax.index.faiss_index import resolve_spec
from dpjax.index.manifest import (DUMP_CODEC as CODEC, DumpConfig, dump_coding_files,
                                  write_manifest)
from dpjax.index.shards import shard_name, write_shard
from dpjax.index.window_maker import kept_slices
from dpjax.io import Progress

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
                 manifest: dict, dim: int, corpus: Iterable[Passage],
                 question_weighting: Callable[[], residual.Weighting] | None = None) -> None:
  """The shards `todo` encoded and written: their kept tokens (`dump_kept`) when the dump
  filters or codes them, else every token's `dim`-d vector, batch by batch
  (`encode_pipelined`). `corpus`: the dump's passages, read again for the codec's sample."""
  if is_kept_layout(config):
    dump_kept(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker, made,
              pipeline, manifest, corpus, question_weighting)
  else:
    encode_pipelined(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker,
                     made, pipeline, dim)


def dump_kept(todo, tokenizer, config: DumpConfig, mesh, encode, out_dir: pathlib.Path,
              progress: Progress, timings: dict, maker, made: dict, pipeline: list,
              manifest: dict, corpus: Iterable[Passage],
              question_weighting: Callable[[], residual.Weighting] | None = None) -> None:
  """Encodes, filters, codes and writes the shards `todo` ((number, passages)), one at a time
  (`encode_pipelined`'s arguments); trains the codec first on a sample of `corpus`
  (`codec_sample`), or reuses the dump's. `manifest`: the dump's, given the codec's record.
  `made`: shard number -> its windows made ahead. `question_weighting`: the model's question
  weighting of a "qw:" codec (`residual`), asked for only when the codec is trained."""
  coder = _existing_coder(out_dir, manifest, config)
  todo = iter(todo)
  job = next(todo, None)
  if coder is None and config.codec:
    if job is None and not (out_dir / CODEC).is_file():
      raise DumpError(f"{out_dir}: no shard left to encode, but no {CODEC}: delete the dump "
                      "and run it again")
    if job is not None:  # (the weighting first: refused before the sample is encoded)
      weighting = _weighting(config, question_weighting)
      coder = _train_coder(out_dir, manifest, config,
                           *codec_sample(corpus, tokenizer, config, mesh, encode),
                           weighting=weighting)
  ahead = None if job is None else made.pop(job[0], None) or maker.submit(job[1])
  while job is not None:
    number, chunk = job
    windows = ahead if isinstance(ahead, list) else timed_result(ahead, pipeline)
    job = next(todo, None)  # the next shard tokenized while this one is encoded
    ahead = None if job is None else made.pop(job[0], None) or maker.submit(job[1])
    tokens = KeptTokens(config.filter_threshold, coder, vectors=config.vectors)
    encode_shard(tokenizer, chunk, config, mesh, encode, progress, windows=windows,
                 timings=timings, stream=lambda: tokens, pipeline=pipeline)
    write_kept_shard(out_dir, number, chunk, tokens.arrays(), config)


class KeptTokens:
  """One shard's encoder outputs taken batch by batch (`encode_shard`'s stream): of the tokens
  the filter keeps (logits max >= `threshold`; None: all), their filter logits, their codes
  (with a `coder`, `residual.ResidualCodes`) and, when asked (`vectors`), their float16
  vectors, each with its row among the shard's encoded tokens; the others are dropped as they
  come, so that no array of the shard's encoded vectors is ever held. A passage-residual
  coder's codes wait for the shard's end (a passage's mean needs all its kept tokens, and a
  shard holds its passages whole), so its kept tokens' vectors are held until then.
  `arrays()` gives them in passage order once the shard is encoded."""

  def __init__(self, threshold: float | None, coder: residual.ResidualCodes | None = None, *,
               vectors: bool):
    self.threshold, self.coder, self.keep_vectors = threshold, coder, vectors
    self.residual = coder is not None and coder.means_codec is not None
    self.parts: dict[str, list[np.ndarray]] = {"rows": [], "filter_logits": [], "codes": [],
                                               "vectors": []}
    self.shard_tables: dict[str, np.ndarray] | None = None
    self.windows: dict = {}
    self.dim = self.num_passages = 0

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
    if self.coder is not None and not self.residual and len(kept):
      self.parts["codes"].append(self.coder.encode(self.coder.space(kept), None))
    if self.keep_vectors or self.residual:
      self.parts["vectors"].append(kept)

  def tables(self, arrays: dict[str, np.ndarray], passages: list, windows: dict) -> None:
    """Takes the shard's token_passage and char_spans (every encoded token) and its windows'
    counts."""
    self.shard_tables, self.windows, self.num_passages = arrays, windows, len(passages)

  def arrays(self) -> dict[str, np.ndarray]:
    """The kept tokens' arrays in passage order (`rows` sorted): filter_logits, codes and
    vectors as taken, char_spans, positions (among their passage's encoded tokens) and
    token_passage; `encoded`: each passage's encoded tokens; `windows`: the windows' counts;
    with a passage-residual coder, passage_means: each passage's coded mean [P, Cm]."""
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
    vectors = None
    if self.keep_vectors or self.residual:
      vectors = _joined(self.parts["vectors"], (self.dim,), np.float16)[order]
      self.parts["vectors"].clear()
    if self.residual:
      out[residual.MEANS[:-4]], out["codes"] = self.coder.shard_codes(
          vectors, np.arange(len(vectors)), out["token_passage"], self.num_passages)
    elif self.coder is not None:
      out["codes"] = _joined(self.parts["codes"], (self.coder.codec.sa_code_size(),),
                             np.uint8)[order]
    if self.keep_vectors:
      out["vectors"] = vectors
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
  for name in ("codes", residual.MEANS[:-4]):
    if name in arrays:
      files[name] = arrays[name]
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
  (it must iterate from its start each time: a list, `read_corpus`'s) until the sample holds
  `sample_targets`' kept tokens and passages holding kept tokens (or the whole corpus)."""
  if iter(corpus) is corpus:
    raise DumpError("index.dump_codec: the codec's sample reads the corpus before its shards, "
                    "so the dump needs a corpus it can read twice (a list, read_corpus's), not "
                    "a one-pass iterator")
  want_tokens, want_passages = sample_targets(config)
  parts, passages, shards, held = [], 0, set(), 0
  chars, above, kept, read_chars, reads = want_tokens * SAMPLE_CHARS_PER_TOKEN, 0.0, 0, 0, 0
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
      held += len(np.unique(arrays["token_passage"]))
    passages += len(taken)
    shards.update(place // config.shard_passages for place, _ in taken)
    read_chars += sum(len(p.text) for _, p in taken)
    log.info("dump codec sample: %d passages read (%d kept tokens)", passages, kept)
    if (kept >= want_tokens and held >= want_passages) or complete:
      return parts, {"passages": passages, "shards": len(shards), "reads": reads}
    # the next read sized by the kept tokens and passages per character so far (some margin
    # for chance)
    chars = (max(chars * 8, 1) if not kept else int(1.25 * read_chars * max(
        (want_tokens - kept) / kept, (want_passages - held) / held)) + 1)


def sample_targets(config: DumpConfig) -> tuple[int, int]:
  """(kept tokens, passages holding kept tokens) the codec's sample needs: `train_size` tokens
  (at most `residual.TRAIN_SAMPLE` for a residual or weighted codec, as an index build draws);
  a passage-residual codec's means codec trains on the sample's passages, and PQ codes them
  once there are `residual.PQ_MEANS_MIN_PASSAGES`, so the sample holds that many where the
  corpus does (`residual.means_codec_spec`)."""
  mods, _ = residual.parse(config.codec)
  if not mods:
    return config.train_size, 0
  return (min(config.train_size, residual.TRAIN_SAMPLE),
          residual.PQ_MEANS_MIN_PASSAGES if "pr" in mods else 0)


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


def _existing_coder(out_dir: pathlib.Path, manifest: dict, config: DumpConfig
                    ) -> residual.ResidualCodes | None:
  """The dump's trained coding when a run made it (its files' digests checked), else None."""
  if not config.codec or not (out_dir / CODEC).is_file():
    return None
  record = manifest.get("codec")
  if record is None:  # a run killed between writing it and recording it: trained again
    return None
  return residual.ResidualCodes.read(out_dir, dump_coding_files(record), CODEC,
                                     "delete the dump's directory and dump again")


def _weighting(config: DumpConfig,
               question_weighting: Callable[[], residual.Weighting] | None
               ) -> residual.Weighting | None:
  """The question weighting of a "qw:" codec (`question_weighting()`), else None."""
  if "qw" not in residual.parse(config.codec)[0]:
    return None
  if question_weighting is None:
    raise ConfigError("index.dump_codec: a question-weighted codec (qw:) needs the model's "
                      "question vectors: dump with `run.py dump`")
  return question_weighting()


def _train_coder(out_dir: pathlib.Path, manifest: dict, config: DumpConfig,
                 parts: list[tuple[np.ndarray, np.ndarray]], sample: dict, *,
                 weighting: residual.Weighting | None) -> residual.ResidualCodes:
  """The coding trained on a seeded draw of the sample's kept tokens (`parts`,
  `codec_sample`'s: each one's place in the corpus and vector; emptied as the draw is
  gathered), written (atomically) with its record (with `sample`'s) in the manifest; refused
  with one line when no token is kept or it cannot train. A residual or weighted codec
  ("[qw+]pr:", `residual`) codes in `weighting` and from the means of the sample's passages,
  trained as an index build trains them."""
  total = sum(len(places) for places, _ in parts)
  if not total:
    raise DumpError(f"{out_dir}: index.dump_filter_threshold {config.filter_threshold} keeps "
                    "none of the tokens encoded for the codec's training sample: lower it")
  mods, factory = residual.parse(config.codec)
  size = min(sample_targets(config)[0], total)
  resolved, notes = resolve_spec(factory, total, config.train_size)
  for note in notes:
    log.warning("dump codec: %s", note)
  dim = int(parts[0][1].shape[1])
  means_spec = None
  if "pr" in mods:  # the means codec of the sample's passages holding kept tokens
    held = len(np.unique(np.concatenate([places for places, _ in parts])))
    means_spec = residual.means_codec_spec(held, dim)
  coder = _new_coder(resolved, dim, means_spec, weighting)
  means = _sample_means(parts, coder) if means_spec else None
  places, vectors = _training_vectors(parts, size)
  try:
    if means is not None:  # (each drawn token's passage mean, every passage's mean)
      coder.train(coder.space(vectors), means[1][np.searchsorted(means[0], places)], means[1])
    elif mods:
      coder.train(coder.space(vectors), None, None)
    else:
      coder.codec.train(vectors)
  except RuntimeError as e:
    raise ConfigError(f"index.dump_codec: {config.codec!r} cannot be trained on {size} tokens "
                      f"({_first_line(e)}); raise index.train_size or choose fewer code bits"
                      ) from None
  files = coder.write(out_dir, CODEC)
  manifest["codec"] = {"spec": residual.joined(mods, resolved), "sha": files.pop(CODEC),
                       "code_size": int(coder.codec.sa_code_size()), "train_tokens": int(size),
                       "notes": notes, "sample": {**sample, "kept_tokens": int(total)},
                       **({"files": files, "means_codec": means_spec} if mods else {})}
  if distributed.is_main():
    write_manifest(out_dir, manifest)
  log.info("dump codec %s trained on %d kept tokens of %d passages across %d shards",
           manifest["codec"]["spec"], size, sample["passages"], sample["shards"])
  return coder


def _new_coder(resolved: str, dim: int, means_spec: str | None,
               weighting: residual.Weighting | None) -> residual.ResidualCodes:
  """The untrained coding of codec `resolved` in `weighting`'s space, with a means codec of
  `means_spec` (None: none)."""
  try:
    codec = faiss.index_factory(dim, resolved, faiss.METRIC_INNER_PRODUCT)
  except RuntimeError as e:
    raise ConfigError(f"index.dump_codec: {resolved!r} is not a faiss factory string "
                      f"({_first_line(e)})") from None
  compact.flat_codes(codec)
  return residual.ResidualCodes(
      codec, means_spec and faiss.index_factory(dim, means_spec, faiss.METRIC_INNER_PRODUCT),
      weighting)


def _sample_means(parts: list[tuple[np.ndarray, np.ndarray]],
                  coder: residual.ResidualCodes) -> tuple[np.ndarray, np.ndarray]:
  """(the corpus places of the sample's passages holding kept tokens [m], sorted; their mean
  kept token in the codes' space [m, D]) from `parts` (`codec_sample`'s)."""
  places, means = [], []
  for part_places, vectors in parts:  # a part's places do not decrease
    held, local = np.unique(part_places, return_inverse=True)
    places.append(held)
    means.append(coder.passage_means(vectors, np.arange(len(vectors)), local, len(held)))
  places, means = np.concatenate(places), np.concatenate(means)
  order = np.argsort(places, kind="stable")
  return places[order], means[order]


def _training_vectors(parts: list[tuple[np.ndarray, np.ndarray]], size: int
                      ) -> tuple[np.ndarray, np.ndarray]:
  """([size] corpus places, [size, D] float32 vectors): a seeded draw (as `faiss_index` draws
  an index's sample) of the kept tokens of `parts` ((corpus places [K], float16 vectors
  [K, D])) taken in corpus order, gathered part by part, each part dropped from `parts` once
  gathered (emptied at the end), so that memory holds about one copy of the sample, not the
  sample and its draw."""
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
  return places[rows], out


def _first_line(error: RuntimeError) -> str:
  return next((line for line in str(error).splitlines() if "rror" in line),
              str(error)[:200]).strip()
