"""Dumping the phrase vectors of a corpus to disk, in shards, resumably (`dump_phrases`).

Every passage is cut into windows like the training data (`dpjax.data.windows`, made ahead of the
encoder by `dpjax.index.window_maker`); each window is encoded by the jitted phrase encoder, sharded
over all devices (fixed batches, padding dropped; `dpjax.index.encode`); of every context token only
the copy from its "max context" window is kept, so token ids are contiguous within a passage and
each token is stored once. The shards' files are `dpjax.index.shards`', written batch by batch
(`dpjax.index.shard_stream`).

`manifest.json` (`dpjax.index.manifest`) says `"complete": true` (and lists the shards) only when
the whole corpus is done. Running the dump again redoes only the missing shards; a dump that is
not complete is refused by the indexer. Several processes can dump together, each encoding its
own shards (see `dump_phrases`). A complete dump is loaded by `dpjax.index.dump_reader.Dump`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pathlib
import time
from typing import Callable, Iterable, Iterator

import faiss
import jax

from dpjax import distributed
from dpjax.data.squad import Passage
from dpjax.data.tokenization import Tokenizer
from dpjax.errors import ConfigError, DataError, DumpError
# Importable from here too: the benchmarks, which also measure trees from before `dump_reader`.
from dpjax.index.dump_reader import Dump  # noqa: F401
from dpjax.index import compact, residual
from dpjax.index.dump_codes import is_kept_layout, write_shards
from dpjax.index.encode import first_shards_ahead
from dpjax.index.manifest import (KEPT_DEFAULTS, MANIFEST, DumpConfig, encoder_fingerprint,
                                  existing_manifest, read_manifest, write_manifest)
from dpjax.index.shards import SHARD_INFO, check_shard_passages, shard_name
from dpjax.index.window_maker import WindowMaker
from dpjax.io import Progress, digest_texts, read_json, remove
from dpjax.models.encoders import bound, call_widths, compile_ahead, phrase_calls
from dpjax.models.densephrases import compute_dtype, with_compute_dtype
from dpjax.parallel import compile_stats

log = logging.getLogger(__name__)


# On an accelerator a dump of a full shard or more compiles the phrase encoder for every call width
# before its first call, all widths at once (`compile_ahead`), sooner than as they come although
# the compiles contend (results/speed_gpu.md). A smaller corpus, whose windows may need few of
# the widths, and a CPU (short compiles; its cores are the tokenizer's and the encoder's)
# compile the widths as they come.
def _compile_ahead(mesh) -> bool:
  return mesh.devices.flat[0].platform != "cpu"


def _batches(iterable: Iterable, size: int) -> Iterator[list]:
  iterator = iter(iterable)
  while chunk := list(itertools.islice(iterator, size)):
    yield chunk


def dump_phrases(model, tokenizer: Tokenizer, passages: Iterable[Passage],
                 out_dir: str | os.PathLike, config: DumpConfig, *, mesh,
                 model_info: dict | None = None, corpus_info: dict | None = None,
                 filter_head: dict | None = None, workers: int = 0,
                 question_weighting: Callable[[], residual.Weighting] | None = None) -> dict:
  """Writes (or resumes) the dump of `passages` into `out_dir`; returns the manifest.

  With several processes (`dpjax.distributed`) every process runs this with the same corpus:
  shard n is encoded by process n mod P on its own devices (`mesh` should be the process's local
  mesh), and process 0 writes the manifest once all shards exist. A shard is done when its
  directory exists (renamed into place complete), so a rerun resumes with the missing ones. Every
  shard records a hash of its passages: a dump is refused for another corpus (`corpus_info`, e.g.
  the files, recorded). `workers` processes tokenize the shards ahead of the encoder (0: one
  thread; `WindowMaker`). `filter_head`: what identifies a separately trained filter head put
  into `model` (None: its own); it and the tokenizer are recorded, and a dump of another one is
  not resumed or redone. A dump with a codec reads `passages` again for its sample
  (`dump_codes.codec_sample`): a list or `read_corpus`'s corpus, not a one-pass iterator; a
  "qw:" codec (`residual`) weights by `question_weighting()`, called when it is trained."""
  model, config = _checked_settings(model, config, mesh)
  out_dir = pathlib.Path(out_dir)
  chunks = _batches(passages, config.shard_passages)
  # The first passages read before anything is written: a corpus that is missing, unreadable or
  # empty is refused without leaving a folder or a manifest behind.
  head = list(itertools.islice(chunks, 1))
  if not head and not (out_dir / MANIFEST).is_file():
    raise DumpError(f"{out_dir}: the corpus is empty")
  chunks = itertools.chain(head, chunks)
  with _undone_if_refused(out_dir), WindowMaker(tokenizer, config, workers) as maker:
    # Shard 0's windows are made (in blocks: encoding starts after 64 passages) while the
    # encoder is hashed: a fresh dump's first job, which nothing else would overlap.
    made = {0: maker.submit_blocks(head[0])} if head and distributed.process_share(0) else {}
    manifest = _new_manifest(model, tokenizer, config, model_info, corpus_info, filter_head)
    encode = bound(model, "phrases_and_filter")
    old = existing_manifest(out_dir, manifest)
    if old is not None and old["complete"]:
      _check_corpus(out_dir, old["shards"], chunks)
      log.info("%s: dump already complete (%d passages, %d tokens)", out_dir,
               old["num_passages"], old["num_tokens"])
      return old
    _prepare(out_dir, manifest, old)
    start, compiled, cpu_start = time.perf_counter(), compile_stats(), time.thread_time()
    counts = {"shards": 0, "resumed": 0}
    todo = _shards_to_encode(out_dir, chunks, counts)
    full_shard = bool(head) and len(head[0]) == config.shard_passages
    if full_shard and maker.workers:  # more shards may follow: tokenized while it compiles
      todo = first_shards_ahead(maker, todo, made)
    # while shard 0's first windows are made; a corpus of one shard at most compiles as it goes
    ahead, ahead_compile = _widths_ahead(encode, config, mesh, full_shard=full_shard)
    timings: dict[str, float] = {}  # map_batches': dispatching, waiting for the encoder, fetching
    pipeline: list[float] = []  # seconds waiting for the tokenizer's and writer's threads
    progress = Progress("dump", unit="tokens", logger=log)  # stored tokens, and tokens/s
    write_shards(todo, tokenizer, config, mesh, encode, out_dir, progress, timings, maker, made,
                 pipeline, manifest, model.config.hidden_size, passages, question_weighting)
  progress.close()
  if counts["resumed"]:
    log.info("%s: %d shards were already done (resumed)", out_dir, counts["resumed"])
  if not counts["shards"]:
    raise DumpError(f"{out_dir}: the corpus is empty")
  manifest.update(_host_times(start, cpu_start, compiled, timings, pipeline, ahead, ahead_compile))
  return _finish(out_dir, manifest, counts["shards"], time.perf_counter() - start)


@contextlib.contextmanager
def _undone_if_refused(out_dir: pathlib.Path):
  """Makes the dump's folder; a refusal (DumpError, ConfigError) before any shard is written
  takes back what this run wrote there (its manifest, a codec), so that nothing half-written
  stays behind for a later run to resume or be refused by (DataError: a question-weighted
  codec's training questions)."""
  before = set(os.listdir(out_dir)) if out_dir.is_dir() else None
  out_dir.mkdir(parents=True, exist_ok=True)
  try:
    yield
  except (DumpError, ConfigError, DataError):
    if not any(out_dir.glob("shard_*")):
      if before is None:
        remove(out_dir)
      else:
        for name in set(os.listdir(out_dir)) - before:
          remove(out_dir / name)
    raise


def _new_manifest(model, tokenizer: Tokenizer, config: DumpConfig, model_info: dict | None,
                  corpus_info: dict | None, filter_head: dict | None) -> dict:
  """An incomplete dump's manifest: what identifies its vectors (`existing_manifest` compares
  them)."""
  # The width multiple is speed only (the vectors differ by rounding at most): recorded, but
  # not a setting a dump is refused or resumed by.
  settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "width_multiple"
              and not (k in KEPT_DEFAULTS and v == KEPT_DEFAULTS[k])}
  return {"complete": False, "fingerprint": encoder_fingerprint(model),
          "model": model_info or {}, "settings": settings,
          "tokenizer": tokenizer.fingerprint, "filter_head": filter_head,
          "width_multiple": config.width_multiple, "corpus": corpus_info or {},
          "dim": model.config.hidden_size, "shards": []}


def _widths_ahead(encode, config: DumpConfig, mesh, full_shard: bool) -> tuple[dict, float]:
  """Compiles the encoder for every call width now (`compile_ahead`) on an accelerator when the
  corpus fills a shard; (the manifest's record of it, its compile time summed over threads)."""
  ahead = {"compile_ahead_seconds": 0.0, "compile_ahead_shapes": 0}
  if not (_compile_ahead(mesh) and full_shard):
    return ahead, 0.0
  start, compiled = time.perf_counter(), compile_stats()["seconds"]
  rows, multiple = phrase_calls(config.batch_size, mesh, config.width_multiple)
  ahead["compile_ahead_shapes"] = compile_ahead(encode, rows,
                                                call_widths(multiple, config.max_seq_length), mesh)
  ahead["compile_ahead_seconds"] = time.perf_counter() - start
  log.info("dump: the phrase encoder compiled (or loaded from the compilation cache) for %d "
           "widths in %.1f s", ahead["compile_ahead_shapes"], ahead["compile_ahead_seconds"])
  return ahead, compile_stats()["seconds"] - compiled


def _host_times(start: float, cpu_start: float, compiled: dict, timings: dict,
                pipeline: list, ahead: dict, ahead_compile: float) -> dict:
  """The manifest's timings of a dump begun at `start` (perf_counter; `cpu_start`: this thread's
  thread_time; `compiled`: compile_stats then; `ahead`: `_widths_ahead`'s record, included,
  `ahead_compile` its compile time).

  `host_seconds`: the main thread's time outside waiting for the encoder and compiling (once per
  window width, `compile_seconds`): the host work per token that caps a dump. On a CPU the
  encoder's threads share the cores with it, so its CPU time (`host_cpu_seconds`) is the work
  itself and the wall time adds the waits for a core. The compiling runs in this thread: its
  wall time is taken off, exact when nothing compiles (a warm dump), else an underestimate (at
  least 0). Widths compiled ahead (`compile_ahead`) compile in other threads at once, their
  compile times summed in `compile_seconds`: their wall time (`compile_ahead_seconds`) is taken
  off instead. `pipeline_wait_seconds`, a part of it: waits for the other threads' work (a
  shard's windows not yet tokenized, shard writes at the end): the pipeline's fill and drain,
  which a dump of many shards spreads thin and a one-shard dump does not; of it
  `write_wait_seconds`, the drain of the writes queued behind the encoder (one writer thread:
  a long one says the writes, not the tokenizer, hold the dump). Two more parts of it,
  the encoder calls' host side (`map_batches`' timings): `dispatch_seconds`, placing the batches
  and launching the encoder (compiles taken off, as above), and `fetch_seconds`, copying its
  computed outputs into numpy arrays (from an accelerator: the device-to-host copies' tail)."""
  compile_seconds = compile_stats()["seconds"] - compiled["seconds"]
  in_this_thread = compile_seconds - ahead_compile
  waited = timings.get("wait", 0.0)
  return dict(encoder_wait_seconds=waited, compile_seconds=compile_seconds,
              compiles=compile_stats()["count"] - compiled["count"], **ahead,
              pipeline_wait_seconds=sum(pipeline),
              write_wait_seconds=timings.get("write_wait", 0.0),
              dispatch_seconds=max(timings.get("dispatch", 0.0) - in_this_thread, 0.0),
              fetch_seconds=timings.get("fetch", 0.0),
              host_seconds=(time.perf_counter() - start - waited - in_this_thread
                            - ahead["compile_ahead_seconds"]),
              host_cpu_seconds=max(time.thread_time() - cpu_start - in_this_thread, 0.0))


def _checked_settings(model, config: DumpConfig, mesh) -> tuple[object, DumpConfig]:
  """Refuses sizes below 1 and windows longer than the model's positions; returns the model
  computing in the dump's dtype (its own when none is set) and the settings naming that dtype
  (recorded in the manifest) and the width multiple the calls on `mesh` round to
  (`phrase_calls`: the platform's when none is set)."""
  if config.shard_passages < 1 or config.batch_size < 1:
    raise DumpError(f"shard_passages ({config.shard_passages}) and batch_size "
                    f"({config.batch_size}) of a dump must be at least 1")
  positions = model.config.max_position_embeddings
  if config.max_seq_length > positions:  # positions past the table embed as NaN (jnp.take)
    raise DumpError(f"dump windows of {config.max_seq_length} tokens (index.dump_max_seq_length "
                    f"or data.max_seq_length) exceed the model's {positions} positions")
  if not config.vectors and not config.codec:
    raise DumpError("index.dump_vectors = False without an index.dump_codec: the dump would "
                    "store no vector; set index.dump_codec")
  if is_kept_layout(config) and jax.process_count() > 1:
    raise DumpError("index.dump_filter_threshold / dump_codec / dump_vectors=False dump in one "
                    "process: unset them, or run the dump with one process")
  model = with_compute_dtype(model, config.compute_dtype or compute_dtype(model))
  codec = config.codec and compact.codec_spec(
      compact.PREFIX + ("" if config.codec == "compact" else config.codec),
      model.config.hidden_size)
  if codec:
    _check_codec(codec, model.config.hidden_size)
  return model, dataclasses.replace(
      config, compute_dtype=compute_dtype(model), codec=codec,
      width_multiple=phrase_calls(config.batch_size, mesh, config.width_multiple)[1])


def _check_codec(codec: str, dim: int) -> None:
  """Refuses (one ConfigError line) a codec faiss cannot make for `dim`-d vectors or that
  stores no flat codes (its residual modifiers aside), before anything is encoded."""
  try:
    compact.flat_codes(faiss.index_factory(dim, residual.parse(codec)[1],
                                           faiss.METRIC_INNER_PRODUCT))
  except RuntimeError as e:
    message = next((line for line in str(e).splitlines() if "rror" in line), str(e)[:200])
    raise ConfigError(f"index.dump_codec: {codec!r} is not a faiss codec for {dim}-d vectors "
                      f"({message.strip()})") from None


def _shards_to_encode(out_dir: pathlib.Path, chunks: Iterable[list], counts: dict):
  """(number, passages) of the shards this process still has to encode (counting all shards
  and the ones already done)."""
  for number, chunk in enumerate(chunks):
    counts["shards"] += 1
    if not distributed.process_share(number):
      continue
    if (out_dir / shard_name(number) / SHARD_INFO).is_file():
      info = read_json(out_dir / shard_name(number) / SHARD_INFO, DumpError,
                       "delete that shard's directory to encode it again")
      check_shard_passages(out_dir, info, chunk)
      counts["resumed"] += 1
      continue
    yield number, chunk


def _check_corpus(out_dir: pathlib.Path, shards: list[dict], chunks: Iterable[list]) -> None:
  """Refuses a corpus whose shards of passages differ from those the complete dump holds."""
  for shard, chunk in itertools.zip_longest(shards, chunks):
    if shard is None or chunk is None:
      raise DumpError(f"{out_dir} holds a dump of {len(shards)} shards, but the corpus now gives "
                      f"{'more' if shard is None else 'fewer'} passages: the corpus changed; "
                      "dump it into a new index.dump_name (or delete the directory)")
    check_shard_passages(out_dir, shard, chunk)


def _prepare(out_dir: pathlib.Path, manifest: dict, old: dict | None) -> None:
  """Removes what a killed run left unfinished and marks a new dump incomplete. An incomplete
  dump's manifest (`old`, of the same model and settings) is left as it is until the dump
  completes: a resume refused for another corpus (its shards checked next) changes nothing.
  The codec a killed run trained (`dump_codes`) is kept in `manifest`, to be reused."""
  if old is not None and "codec" in old:
    manifest["codec"] = old["codec"]
  if distributed.is_main():
    for leftover in out_dir.glob("*.tmp"):  # a shard a killed run did not finish
      remove(leftover)
    # (one written before the tokenizer and filter head were recorded gets them now, so that a
    # later resume with another of either is refused)
    if old is None or any(key not in old for key in ("tokenizer", "filter_head")):
      write_manifest(out_dir, manifest)
  distributed.barrier("dump-start")


def _finish(out_dir: pathlib.Path, manifest: dict, num_shards: int, seconds: float) -> dict:
  """Once every process's shards exist, process 0 marks the dump complete."""
  distributed.barrier("dump-shards")
  if distributed.is_main():
    manifest["shards"] = [json.loads((out_dir / shard_name(n) / SHARD_INFO).read_text())
                          for n in range(num_shards)]
    manifest.update(complete=True,
                    num_passages=sum(s["passages"] for s in manifest["shards"]),
                    num_tokens=sum(s["tokens"] for s in manifest["shards"]),
                    # the tokens encoded, before a dump-time filter (`dump_codes`)
                    context_tokens=sum(s.get("context_tokens", s["tokens"])
                                       for s in manifest["shards"]),
                    # the windows' real tokens (None: a shard made before they were counted)
                    encoded_tokens=_total(manifest["shards"], "encoded_tokens"),
                    num_windows=_total(manifest["shards"], "windows"),
                    seconds=seconds, processes=jax.process_count())
    # the shards' bytes on disk per context token, before a dump-time filter (what a corpus
    # costs per token: issue 69 asks <= 16 for Wikipedia)
    manifest["bytes_per_token"] = sum(f["bytes"] for s in manifest["shards"] for f in s.get(
        "files", {}).values()) / max(manifest["context_tokens"], 1)
    # What an index built from this dump records, to be refused against any other dump.
    manifest["dump_id"] = digest_texts(manifest["fingerprint"], json.dumps(manifest["settings"]),
                                       *(s.get("passages_sha", "") for s in manifest["shards"]))
    write_manifest(out_dir, manifest)
  distributed.barrier("dump-manifest")
  return read_manifest(out_dir)


def _total(shards: list[dict], key: str) -> int | None:
  """The shards' `key` summed (None if a shard lacks it)."""
  return sum(s[key] for s in shards) if all(key in s for s in shards) else None
