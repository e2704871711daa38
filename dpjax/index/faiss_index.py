"""faiss indexes over a dump's token vectors (inner product).

`spec` is a faiss factory string: `Flat` (exact), `IVF<nlist>,SQ4` / `IVF<nlist>,SQ8`, or
`OPQ<m>,IVF<nlist>,PQ<m>x<bits>`; `IVFauto` picks nlist ~ 4 sqrt(N). On small corpora nlist is
clamped to N / 39 (faiss's minimum training points per centroid) and PQ bits to log2(N), with a
log line saying so, instead of failing. A token-filter threshold drops tokens whose start and end
filter logits are both below it. Every vector is added with its global token id in the dump as
faiss label, and the index is written with a manifest (spec, counts, nprobe, the dump's
fingerprint) into `<dump>/indexes/<name>/`, via a temporary directory renamed when complete.
"""
from __future__ import annotations

import logging
import math
import os
import pathlib
import re
import time
from typing import Callable

import faiss
import jax
import numpy as np

from dpjax import distributed
from dpjax.errors import ConfigError, DumpError
from dpjax.index import compact, residual
from dpjax.index.dump_reader import require_vectors, shard_passages
from dpjax.index.manifest import (DUMP_CODEC as CODEC, INDEX_MANIFEST as MANIFEST,
                                  dump_coding_files, kept_settings, read_manifest)
from dpjax.index.passage_store import PassageWriter
from dpjax.index.shards import (shard_context_offsets, shard_problems, shard_rerun,
                                shard_token_layout, shard_token_offsets)
from dpjax.io import (checksum_problems, commit_directory, folder_checksums,
                      refuse_damage, remove, write_json)

log = logging.getLogger(__name__)


def tune_exact_search() -> None:
  """Sends exact (flat) inner-product searches of 20 queries or more through BLAS, in blocks of
  1,024 queries x 65,536 vectors (256 MiB of scratch).

  faiss 1.15's defaults run searches of fewer than 128,000 queries through its sequential
  kernel, or through BLAS in 1,024-vector database blocks, an order of magnitude slower for a
  batch of questions with the same results (results/code_measurements.md). Flat indexes and IVF
  coarse quantizers both search this way.
  """
  faiss.cvar.distance_compute_blas_threshold = 20
  faiss.cvar.distance_compute_blas_query_bs = 1024
  faiss.cvar.distance_compute_blas_database_bs = 65536


tune_exact_search()


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
  match = re.search(r"(?<![A-Za-z])PQ(\d+)(?:x(\d+))?(?![\dxf])", spec)
  if match:
    bits = int(match.group(2) or 8)  # faiss's default: 8 bits (256 centroids per sub-vector)
    allowed = max(1, min(bits, int(math.log2(max(n_train, 2)))))
    if allowed != bits:
      notes.append(f"PQ bits {bits} clamped to {allowed}: {n_train} training vectors")
      spec = spec[:match.start()] + f"PQ{match.group(1)}x{allowed}" + spec[match.end():]
  match = re.match(r"OPQ\d+(_\d+)?,", spec)
  if match and n_train < 256:  # OPQ trains its rotation with 8-bit PQ codebooks of its own
    notes.append(f"{match.group(0)[:-1]} dropped: {n_train} training vectors, fewer than the "
                 "256 its rotation's training needs")
    spec = spec[match.end():]
  return spec, notes


def _use_gpu() -> bool:
  return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _shard_arrays(dump_dir: pathlib.Path, shard: dict, key: str) -> np.ndarray:
  """A shard's array `key`, memory mapped, its size checked against the one recorded."""
  path = dump_dir / shard["name"] / f"{key}.npy"
  refuse_damage(shard_problems(path.parent, shard, contents=False, names=[path.name]), DumpError,
                "dump", shard_rerun(path.parent))
  try:
    return np.load(path, mmap_mode="r")
  except (OSError, ValueError) as e:
    raise DumpError(f"{path}: shard is missing or damaged ({type(e).__name__}: {e}); delete the "
                    "dump and run it again") from None


def index_folder(spec: str, filter_threshold: float | None = None) -> str:
  """The folder (under <dump>/indexes) of the index a factory string builds: "IVFauto,SQ4" ->
  "IVFauto_SQ4", "Flat" with threshold 0.5 -> "Flat_filter0.5" (`index.search_index` names it)."""
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", spec) + (
      f"_filter{filter_threshold:g}" if filter_threshold is not None else "")


def _kept(dump_dir: pathlib.Path, shard: dict, filter_threshold: float | None) -> np.ndarray:
  """Shard-local rows of the tokens that pass the filter."""
  if filter_threshold is None:
    return np.arange(shard["tokens"], dtype=np.int64)
  logits = np.asarray(_shard_arrays(dump_dir, shard, "filter_logits"), np.float32)
  return np.flatnonzero(logits.max(1) >= filter_threshold)


def build_index(dump_dir: str | os.PathLike, spec: str = "Flat", *, name: str | None = None,
                filter_threshold: float | None = None, train_size: int = 1_000_000,
                nprobe: int = 256, seed: int = 0,
                weighting: residual.Weighting | Callable[[], residual.Weighting] | None = None
                ) -> pathlib.Path:
  """Builds and writes a faiss index over a complete dump; returns the index directory.

  The index's labels are the dump's global token ids. Shards are read one at a time (memory
  mapped), so memory holds the index and one shard. With several processes
  (`dpjax.distributed`): process 0 trains the (empty) index on a sample of all shards, every
  process adds the vectors of its own shards (shard n: process n mod P) to a copy, and process 0
  merges the parts (faiss `merge_from`) into one index. The index is built in `<name>.tmp` and
  renamed into place complete; a failed build removes its temporary directory. A compact
  spec (`dpjax.index.compact`: "compact:OPQ32,PQ32") builds that kind instead; a question-weighted
  one ("compact:qw+pr:OPQ32,PQ32", `dpjax.index.residual`) codes in the space of `weighting` (or
  of the one a function `weighting()` gives, called only then), unless the dump holds codes of
  that codec (`index.dump_codec`), which are assembled with the dump's weighting.
  """
  dump_dir = pathlib.Path(dump_dir)
  if compact.is_compact(spec):
    return _build_compact(dump_dir, spec, name=name, filter_threshold=filter_threshold,
                          train_size=train_size, seed=seed, nprobe=nprobe, weighting=weighting)
  require_vectors(read_manifest(dump_dir), dump_dir, f"index.specs {spec!r}")
  plan = _plan(dump_dir, spec, filter_threshold, train_size)
  name = name or index_folder(spec, filter_threshold)
  final = dump_dir / "indexes" / name
  tmp = final.with_name(final.name + ".tmp")
  start = time.perf_counter()
  try:
    index = _trained(plan, tmp, name, min(train_size, plan["total_kept"]), seed)
    index = _add_shards(index, plan, _use_gpu() and plan["resolved"] != "Flat")
    index = _merge_parts(index, tmp, name, plan["resolved"])
    if distributed.is_main():
      _write(index, plan, tmp, final, spec=spec, nprobe=nprobe,
             seconds=time.perf_counter() - start)
  except BaseException:
    if distributed.is_main():
      remove(tmp)
    raise
  distributed.barrier(f"index-{name}-done")
  return final


def _plan(dump_dir: pathlib.Path, spec: str, filter_threshold, train_size: int) -> dict:
  """What an index over the dump holds: the kept tokens of each shard and the resolved spec."""
  dump = read_manifest(dump_dir)
  offsets = shard_token_offsets(dump)
  kept_counts = [len(_kept(dump_dir, s, filter_threshold)) for s in dump["shards"]]
  total_kept = sum(kept_counts)
  if filter_threshold is not None:
    log.info("filter threshold %.3f keeps %d of %d tokens (%.1f%%)", filter_threshold,
             total_kept, offsets[-1], 100 * total_kept / max(offsets[-1], 1))
  if not offsets[-1]:  # every passage tokenized to nothing (e.g. only format characters)
    raise DumpError(f"{dump_dir}: the dump holds no token ({dump['num_passages']} passages, "
                    "none with a token the tokenizer keeps): nothing to index; check "
                    "index.corpus")
  if not total_kept:
    raise DumpError(f"{dump_dir}: no token passes the filter threshold {filter_threshold}")
  resolved, notes = resolve_spec(spec, total_kept, train_size)
  for note in notes:
    log.warning("%s", note)
  return {"dump_dir": dump_dir, "dump": dump, "shards": dump["shards"], "offsets": offsets,
          "kept_counts": kept_counts, "total_kept": total_kept, "resolved": resolved,
          "notes": notes, "filter_threshold": filter_threshold}


def _trained(plan: dict, tmp: pathlib.Path, name: str, size: int, seed: int):
  """The empty index, trained by process 0 and read back from a file by every process."""
  index = None
  if distributed.is_main():
    remove(tmp)
    tmp.mkdir(parents=True)
    resolved = plan["resolved"]
    # Labels are token ids: an index without ids of its own (all but IVF) is wrapped in IDMap.
    index = _new_index(plan, resolved if "IVF" in resolved else "IDMap," + resolved, size, seed)
    if jax.process_count() > 1:
      _write_index(index, tmp / "trained.faiss")
  distributed.barrier(f"index-{name}-trained")
  if jax.process_count() > 1:  # every part read back from the file: types match for merging
    index = faiss.read_index(str(tmp / "trained.faiss"))
  return index


def _new_index(plan: dict, factory: str, size: int, seed: int, check=None, train: bool = True):
  """The index of a faiss factory string over the dump's vectors (inner product), trained on
  `size` kept tokens if it needs training (and `train`); `check(index)` refuses one before its
  training."""
  resolved, dim = plan["resolved"], plan["dump"]["dim"]
  try:
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
  except RuntimeError as e:
    raise ConfigError(f"index.specs: {resolved!r} is not a faiss index factory string "
                      f"for {dim}-d vectors ({_faiss_message(e)})") from None
  if check is not None:
    check(index)
  if train and not index.is_trained:
    try:
      index = _train(index, plan["dump_dir"], plan["shards"], plan["offsets"],
                     plan["kept_counts"], plan["filter_threshold"], size, seed)
    except RuntimeError as e:
      raise ConfigError(f"index.specs: {resolved!r} cannot be trained on {size} vectors "
                        f"({_faiss_message(e)})") from None
  return index


def _add_shards(index, plan: dict, gpu: bool):
  """Adds the kept vectors of this process's shards, labelled by global token id."""
  adder = faiss.index_cpu_to_all_gpus(index) if gpu else index
  for number, shard in enumerate(plan["shards"]):
    if not distributed.process_share(number):
      continue
    rows = _kept(plan["dump_dir"], shard, plan["filter_threshold"])
    vectors = _shard_arrays(plan["dump_dir"], shard, "vectors")
    for lo in range(0, len(rows), 1 << 18):  # bounded float32 copies
      part = rows[lo:lo + (1 << 18)]
      adder.add_with_ids(np.asarray(vectors[part], np.float32), part + plan["offsets"][number])
  return faiss.index_gpu_to_cpu(adder) if adder is not index else index


def _merge_parts(index, tmp: pathlib.Path, name: str, resolved: str):
  """With several processes, process 0 merges the others' parts into its index."""
  if jax.process_count() == 1:
    return index
  if not distributed.is_main():
    _write_index(index, tmp / f"part_{jax.process_index()}.faiss")
  distributed.barrier(f"index-{name}-parts")
  if distributed.is_main():
    for other in range(1, jax.process_count()):
      part_path = tmp / f"part_{other}.faiss"
      part = faiss.read_index(str(part_path))
      index.merge_from(part, 0) if "IVF" in resolved else index.merge_from(part)
      part_path.unlink()
    (tmp / "trained.faiss").unlink()
  return index


def _write(index, plan: dict, tmp: pathlib.Path, final: pathlib.Path, *, spec: str,
           nprobe: int, seconds: float) -> None:
  """Writes the index and its manifest into `tmp` and renames it to `final`."""
  if index.ntotal != plan["total_kept"]:
    raise DumpError(f"{final}: the index holds {index.ntotal} vectors, expected "
                    f"{plan['total_kept']}")
  _write_index(index, tmp / "index.faiss")
  manifest = {**_record(plan, spec, seconds), "resolved_spec": plan["resolved"],
              "labels": "token_id", "nprobe": nprobe, "processes": jax.process_count(),
              "index_bytes": (tmp / "index.faiss").stat().st_size,
              "files": folder_checksums(tmp, skip=[MANIFEST])}  # (`check_index`)
  write_json(tmp / MANIFEST, manifest)
  commit_directory(tmp, final)
  log.info("index %s: %d vectors, %s, %.1f s, %.1f bytes/token", final, plan["total_kept"],
           plan["resolved"], seconds, manifest["index_bytes"] / plan["total_kept"])


def _record(plan: dict, spec: str, seconds: float) -> dict:
  """An index manifest's fields of every kind: what it was built from and how."""
  return {"spec": spec, "notes": plan["notes"], "num_tokens": int(plan["total_kept"]),
          "dump_tokens": int(plan["offsets"][-1]), "filter_threshold": plan["filter_threshold"],
          # the head whose logits the threshold kept tokens by (`run.py filter` rewrites)
          "filter_head": plan["dump"].get("filter_head"),
          "fingerprint": plan["dump"]["fingerprint"],
          "dump_id": plan["dump"].get("dump_id", ""), "build_seconds": seconds}


def _build_compact(dump_dir: pathlib.Path, spec: str, *, name: str | None,
                   filter_threshold: float | None, train_size: int, seed: int, nprobe: int,
                   weighting: residual.Weighting | Callable[[], residual.Weighting] | None
                   ) -> pathlib.Path:
  """Builds a compact index (`dpjax.index.compact`) in `<name>.tmp`, renamed complete: its
  codec trained on a sample of the kept tokens, then every shard's kept tokens encoded, one
  shard at a time (memory mapped); or, over a dump of that codec's codes, assembled from them.
  Process 0 builds it; the others wait."""
  dump = read_manifest(dump_dir)
  mods, factory = residual.parse(compact.codec_spec(spec, dump["dim"]))
  codec = _dump_codec(dump, spec, mods)
  if codec:  # the dump's own codes (a residual one's means and weighting too)
    mods, factory = residual.parse(codec)
  elif mods:  # residuals or weighting: coded from the dump's vectors
    require_vectors(dump, dump_dir, f"index.specs {spec!r}")
    weighting = weighting() if callable(weighting) and "qw" in mods else weighting
    if "qw" in mods and weighting is None:
      raise ConfigError(f"index.specs {spec!r}: question weighting needs the model's question "
                        "vectors; build it with `run.py index` (it encodes the training "
                        "questions of index.sparse_tune_questions)")
  plan = _plan(dump_dir, factory, filter_threshold, train_size)  # (none kept: refused)
  plan["modifiers"], plan["nprobe"] = mods, nprobe
  final = dump_dir / "indexes" / (name or index_folder(spec, filter_threshold))
  tmp = final.with_name(final.name + ".tmp")
  if distributed.is_main():
    start = time.perf_counter()
    # the dump's coding read (its digests checked) before anything is written
    coder, plan["means_codec"] = _read_coder(dump_dir, dump) if codec else (None, None)
    try:
      remove(tmp)
      tmp.mkdir(parents=True)
      if codec:  # the dump's own codes: assembled, nothing trained or encoded
        index, plan["resolved"], plan["notes"] = coder.codec, factory, []
        coder = coder if mods else None
      elif mods:
        coder = _trained_residual(plan, mods, weighting, min(train_size, plan["total_kept"]),
                                  seed)
        index = coder.codec
      else:
        index = _new_index(plan, plan["resolved"], min(train_size, plan["total_kept"]), seed,
                           check=compact.flat_codes)
      positions = _encode_shards(index, plan, tmp, coded=bool(codec), coder=coder)
      _write_compact(index, plan, tmp, final, spec=spec, positions=positions,
                     seconds=time.perf_counter() - start, coder=coder)
    except BaseException:
      remove(tmp)
      raise
  distributed.barrier(f"index-{final.name}-done")
  return final


def _dump_codec(dump: dict, spec: str, mods: frozenset) -> str:
  """The codec of a dump (its manifest `dump`) coded at dump time (`index.dump_codec`; "":
  none) that the compact `spec` (of modifiers `mods`) assembles its index from; "" for a
  residual or weighted spec of another codec (coded from the dump's vectors); a ConfigError
  when a plain spec names another codec."""
  codec = kept_settings(dump["settings"])["codec"]
  if not codec:
    return ""
  resolved = dump.get("codec", {}).get("spec", codec)
  wanted = compact.codec_spec(spec, dump["dim"])
  if spec == compact.PREFIX[:-1] or wanted in (codec, resolved):
    return resolved
  if mods:
    return ""
  raise ConfigError(f"index.specs: {spec!r} codes with {wanted}, the dump's codes are "
                    f"{resolved} (index.dump_codec {codec!r}): use \"compact\", or dump again "
                    "with that index.dump_codec")


def _read_coder(dump_dir: pathlib.Path, dump: dict) -> tuple[residual.ResidualCodes, str | None]:
  """(the dump's trained coding (`dump_codes`), its files' digests checked against its
  manifest `dump`; its means codec's spec, None without one)."""
  record = dump.get("codec", {})
  if "sha" not in record:
    raise DumpError(f"{dump_dir / CODEC}: not recorded in the dump's manifest; delete the dump "
                    "and run it again")
  coder = residual.ResidualCodes.read(dump_dir, dump_coding_files(record), CODEC,
                                      "delete the dump and run it again")
  return coder, record.get("means_codec")


def _encode_shards(codec, plan: dict, tmp: pathlib.Path, coded: bool = False,
                   coder: residual.ResidualCodes | None = None) -> bool:
  """Writes the compact index's parts into `tmp` a shard at a time: the kept tokens' codes (the
  dump's, when `coded`), spans and places in their passages, both passage offsets (over the
  encoded tokens, a dump-time filter's dropped ones too) and the passage store. The arrays are
  files of the sizes the dump's manifest gives, mapped again for each shard's rows and unmapped
  after, so that memory holds one shard's arrays and pages whatever the corpus's size. Returns
  whether positions were written (only where some tokens are not kept). A residual index's
  `coder` codes them (`_encode_shard`) and its passages' means (`passage_means.npy`)."""
  dump_dir, dump = plan["dump_dir"], plan["dump"]
  filtered = (plan["filter_threshold"] is not None
              or kept_settings(dump["settings"])["filter_threshold"] is not None)
  last_char, longest = _compact_widths(dump_dir, plan["shards"])
  kept, passages = (plan["total_kept"],), (dump["num_passages"] + 1,)
  parts = {"codes": (np.uint8, kept + (compact.flat_codes(codec).code_size,)),
           "char_spans": (compact.span_dtype(last_char), kept + (2,)),
           "passage_offsets": (np.int64, passages), "kept_offsets": (np.int64, passages)}
  if filtered:
    parts["positions"] = (compact.span_dtype(longest), kept)
  if coder is not None and coder.means_codec is not None:
    parts[residual.MEANS[:-4]] = (np.uint8, (dump["num_passages"],
                                             compact.flat_codes(coder.means_codec).code_size))
  for name, (dtype, shape) in parts.items():
    np.lib.format.open_memmap(tmp / f"{name}.npy", "w+", dtype, shape).flush()  # (zeros)
  at = {"kept": 0, "row": 0, "token": 0}
  with PassageWriter(tmp, dump["num_passages"]) as passages_out:
    for shard in plan["shards"]:
      _encode_shard(codec, plan, shard, {name: tmp / f"{name}.npy" for name in parts}, at,
                    coded, coder)
      for passage in shard_passages(dump_dir / shard["name"]):
        passages_out.add(passage)
  if at["kept"] != plan["total_kept"] or at["token"] != shard_context_offsets(dump)[-1]:
    raise DumpError(f"{dump_dir}: its shards hold {at['kept']} kept of {at['token']} tokens, "
                    f"not the {plan['total_kept']} its manifest counts; delete the dump and run "
                    "it again")
  return filtered


def _compact_widths(dump_dir: pathlib.Path, shards: list) -> tuple[int, int]:
  """(the last character a token ends at, the most tokens a passage encodes) of the dump: the
  widths of a compact index's spans and positions."""
  last_char = longest = 0
  for shard in shards:
    last_char = max(last_char, int(np.max(_shard_arrays(dump_dir, shard, "char_spans"),
                                          initial=0)))
    longest = max(longest, int(np.max(shard_token_layout(dump_dir / shard["name"], shard)[2],
                                      initial=0)))
  return last_char, longest


def _trained_residual(plan: dict, mods: frozenset, weighting: residual.Weighting | None,
                      size: int, seed: int) -> residual.ResidualCodes:
  """The coding of a residual / weighted compact index (`residual.ResidualCodes`), its codecs
  trained on a seeded sample of the kept tokens (at most `residual.TRAIN_SAMPLE`) and of the
  passages' means."""
  dim = plan["dump"]["dim"]
  codec = _new_index(plan, plan["resolved"], size, seed, check=compact.flat_codes, train=False)
  means_codec = None
  if "pr" in mods:
    plan["means_codec"] = residual.means_codec_spec(plan["dump"]["num_passages"], dim)
    means_codec = faiss.index_factory(dim, plan["means_codec"], faiss.METRIC_INNER_PRODUCT)
  coder = residual.ResidualCodes(codec, means_codec, weighting if "qw" in mods else None)
  size = min(size, residual.TRAIN_SAMPLE)
  try:
    coder.train(*_residual_sample(plan, coder, size, seed))
  except RuntimeError as e:
    raise ConfigError(f"index.specs: {plan['resolved']!r} (residual codes) cannot be trained on "
                      f"{size} vectors ({_faiss_message(e)})") from None
  return coder


def _residual_sample(plan: dict, coder: residual.ResidualCodes, size: int, seed: int) -> tuple:
  """(a seeded draw of `size` kept tokens [n, D], their passages' means [n, D] or None, a
  draw of the passages' means [m, D] or None), all in the codes' space, one shard at a time."""
  dump_dir, shards = plan["dump_dir"], plan["shards"]
  rng = np.random.default_rng(seed)
  picks = np.sort(rng.choice(plan["total_kept"], size=size, replace=False))
  bounds = np.concatenate([[0], np.cumsum(plan["kept_counts"])])
  share = min(1.0, residual.TRAIN_SAMPLE / max(plan["dump"]["num_passages"], 1))
  tokens, token_means, means_sample = [], [], []
  for number, shard in enumerate(shards):
    mine = picks[(picks >= bounds[number]) & (picks < bounds[number + 1])] - bounds[number]
    if not len(mine) and coder.means_codec is None:
      continue
    rows = _kept(dump_dir, shard, plan["filter_threshold"])
    token_passage, _, encoded = shard_token_layout(dump_dir / shard["name"], shard)
    passage = token_passage[rows]
    tokens.append(coder.space(_shard_arrays(dump_dir, shard, "vectors")[rows[mine]]))
    if coder.means_codec is not None:
      means = _shard_means(plan, shard, rows, passage, len(encoded), coder)
      token_means.append(means[passage[mine]])
      held = np.flatnonzero(np.bincount(passage, minlength=len(encoded)))  # passages with tokens
      means_sample.append(means[held[rng.random(len(held)) < share]])
  if coder.means_codec is None:
    return np.concatenate(tokens), None, None
  return np.concatenate(tokens), np.concatenate(token_means), np.concatenate(means_sample)


def _shard_means(plan: dict, shard: dict, rows: np.ndarray, passage: np.ndarray,
                 num_passages: int, coder: residual.ResidualCodes) -> np.ndarray:
  """[num_passages, D] the mean kept vector (the codes' space) of each of a shard's passages
  (zeros for one without kept tokens), from its kept `rows` of shard-local passages
  `passage`, a bounded chunk at a time."""
  return coder.passage_means(_shard_arrays(plan["dump_dir"], shard, "vectors"), rows, passage,
                             num_passages)


def _encode_shard(codec, plan: dict, shard: dict, paths: dict, at: dict, coded: bool,
                  coder: residual.ResidualCodes | None = None) -> None:
  """Writes one shard's kept tokens and passage offsets into the compact index's array files
  `paths` (by part), from the ranks, passage rows and token ids `at` (moved past them); with
  a residual `coder`, its passages' coded means too, and the tokens' residuals from them."""
  dump_dir = plan["dump_dir"]
  out = {name: np.lib.format.open_memmap(path, "r+") for name, path in paths.items()}
  rows = _kept(dump_dir, shard, plan["filter_threshold"])
  token_passage, ids, encoded = shard_token_layout(dump_dir / shard["name"], shard)
  passage = token_passage[rows]
  source = _shard_arrays(dump_dir, shard, "codes" if coded else "vectors")
  first, row = at["kept"], at["row"]
  if coded:  # the dump's codes (and a residual dump's means codes)
    out["codes"][first:first + len(rows)] = source[rows]
    if coder is not None and coder.means_codec is not None:
      out[residual.MEANS[:-4]][row:row + len(encoded)] = _shard_arrays(dump_dir, shard,
                                                                       residual.MEANS[:-4])
  elif coder is not None:
    means, out["codes"][first:first + len(rows)] = coder.shard_codes(source, rows, passage,
                                                                     len(encoded))
    if means is not None:
      out[residual.MEANS[:-4]][row:row + len(encoded)] = means
  else:
    for lo in range(0, len(rows), residual.CHUNK):  # bounded float32 copies
      part = rows[lo:lo + residual.CHUNK]
      out["codes"][first + lo:first + lo + len(part)] = codec.sa_encode(
          np.asarray(source[part], np.float32))
  out["char_spans"][first:first + len(rows)] = _shard_arrays(dump_dir, shard, "char_spans")[rows]
  if "positions" in out:  # each kept token's id among its passage's encoded ones
    starts = np.concatenate([[0], np.cumsum(encoded)[:-1]]).astype(np.int64)
    out["positions"][first:first + len(rows)] = ids[rows] - starts[passage]
  out["passage_offsets"][row + 1:row + len(encoded) + 1] = at["token"] + np.cumsum(encoded)
  out["kept_offsets"][row + 1:row + len(encoded) + 1] = first + np.cumsum(
      np.bincount(passage, minlength=len(encoded)))
  for array in out.values():
    array.flush()
  at["kept"] += len(rows)
  at["row"] += len(encoded)
  at["token"] += int(np.sum(encoded))


def _write_compact(codec, plan: dict, tmp: pathlib.Path, final: pathlib.Path, *, spec: str,
                   positions: bool, seconds: float,
                   coder: residual.ResidualCodes | None = None) -> None:
  """Writes the compact index's codec (a residual one's means codec and weighting too) and
  manifest (the bytes of each part) into `tmp` and renames it to `final`."""
  _write_index(codec, tmp / "codec.faiss")
  mods = plan.get("modifiers", ())
  if coder is not None and coder.means_codec is not None:
    _write_index(coder.means_codec, tmp / residual.MEANS_CODEC)
  if coder is not None and coder.weighting is not None:
    np.save(tmp / residual.WEIGHTING, coder.weighting.root)
  tokens = int(shard_context_offsets(plan["dump"])[-1])  # encoded, a dump-time filter's too
  parts = compact.part_bytes(tmp, tokens)
  size = sum(p["bytes"] for p in parts.values())
  manifest = {**_record(plan, spec, seconds), "kind": "compact", "dump_tokens": tokens,
              "positions": positions, "num_passages": int(plan["dump"]["num_passages"]),
              "resolved_spec": compact.PREFIX + residual.joined(mods, plan["resolved"]),
              "codec": plan["resolved"], "residual": "pr" in mods, "weighted": "qw" in mods,
              "nprobe": plan.get("nprobe"), "means_codec": plan.get("means_codec"),
              "code_size": int(compact.flat_codes(codec).code_size), "labels": "kept_rank",
              "processes": 1, "index_bytes": size, "bytes_per_token": size / tokens,
              "parts": parts, "files": folder_checksums(tmp, skip=[MANIFEST])}
  write_json(tmp / MANIFEST, manifest)
  commit_directory(tmp, final)
  log.info("compact index %s: %d of %d tokens, %s, %.1f s, %.2f bytes per dump token", final,
           plan["total_kept"], tokens, plan["resolved"], seconds, size / tokens)


def index_problems(directory: pathlib.Path, manifest: dict, *, contents: bool,
                   reuse_stamps: bool = True) -> list[str]:
  """What is wrong with an index's files against the sizes and digests its manifest recorded
  (`checksum_problems`, which `reuse_stamps` passes to; an index built before they were
  recorded: nothing)."""
  return checksum_problems(directory, manifest.get("files", {}), contents=contents,
                           reuse_stamps=reuse_stamps)


def check_index(directory: pathlib.Path, manifest: dict, *, contents: bool = False) -> None:
  """Refuses an index whose files are missing, of other sizes or (`contents`) of other bytes
  than when written (a DumpError naming the first); one without digests is used, unverified."""
  refuse_damage(index_problems(directory, manifest, contents=contents), DumpError, "index",
                "build it again with `run.py index`")
  if "files" not in manifest:
    log.warning("%s: an index built before digests were recorded: unverified", directory)


def _faiss_message(error: RuntimeError) -> str:
  """The message line of a faiss error (its text is a C++ stack)."""
  return next((line for line in str(error).splitlines() if "rror" in line),
              str(error)[:200]).strip()


def _write_index(index, path: pathlib.Path) -> None:
  """`faiss.write_index`, whose failures (a full disk, a quota) are RuntimeErrors: a DumpError
  naming the file and the cause."""
  try:
    faiss.write_index(index, str(path))
  except RuntimeError as e:
    raise DumpError(f"{path}: could not write the index ({_faiss_message(e)})") from None


def _train(index, dump_dir, shards, offsets, kept_counts, filter_threshold, size: int, seed: int):
  """Trains `index` on `size` kept tokens drawn uniformly (seeded) from all shards."""
  rng = np.random.default_rng(seed)
  picks = np.sort(rng.choice(sum(kept_counts), size=size, replace=False))  # kept-token ordinals
  bounds = np.concatenate([[0], np.cumsum(kept_counts)])
  sample = []
  for number, shard in enumerate(shards):
    mine = picks[(picks >= bounds[number]) & (picks < bounds[number + 1])] - bounds[number]
    if len(mine):
      rows = _kept(dump_dir, shard, filter_threshold)[mine]
      sample.append(np.asarray(_shard_arrays(dump_dir, shard, "vectors")[rows], np.float32))
  trainer = faiss.index_cpu_to_all_gpus(index) if _use_gpu() else index
  trainer.train(np.concatenate(sample))
  return faiss.index_gpu_to_cpu(trainer) if trainer is not index else index
