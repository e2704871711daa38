"""A dump's and an index's manifests: read (older fields normalised once, here), written, and
checked against each other, the model and the config before any shard is read.

`<dump>/manifest.json` says `"complete": true` (and lists the shards) only when the whole corpus
is done; it carries a fingerprint of the phrase encoder, so that search can check that questions
are encoded by the model that produced the vectors, the settings the windows were made with, and
a dump id that its indexes (`<dump>/indexes/<name>/index_manifest.json`) record.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable

import jax
import numpy as np
from flax import nnx

from dpjax.errors import DataError, DumpError
from dpjax.io import digest, read_json, write_json
from dpjax.parallel import round_to_devices
from dpjax.settings import DataSettings, IndexSettings

MANIFEST = "manifest.json"
INDEX_MANIFEST = "index_manifest.json"
DUMP_CODEC = "codec.faiss"  # a dump's codec, trained at dump time (`dpjax.index.dump_codes`)
# The manifests' format, written with every dump manifest: 2 records every setting. A manifest
# without one is of format 1, whose missing settings are what they were before they were
# recorded: doc_stride windows (no min_context), a float32 encoder. They are filled in once, when
# a manifest is read (`load_manifest`), so that no check keeps defaults of its own.
FORMAT = 2
LEGACY_SETTINGS = {"min_context": 0, "compute_dtype": "float32"}


def params_fingerprint(module) -> str:
  """A short hash of a module's parameters."""
  return digest(*(np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(module, nnx.Param))))


def encoder_fingerprint(model) -> str:
  """A short hash of the phrase encoder's parameters (identifies the model of a dump)."""
  return params_fingerprint(model.phrase_encoder)


@dataclasses.dataclass
class DumpConfig:
  """A dump's settings (`dump_config` reads them from an experiment config)."""
  max_seq_length: int = 384
  doc_stride: int = 128
  include_title: bool = True
  batch_size: int = 64
  shard_passages: int = 2000
  # > 0: windows spaced as widely as keeps this much context around every token (fewer tokens
  # encoded twice; `build_windows`), instead of every doc_stride tokens as in training.
  min_context: int = 0
  # The encoder's compute dtype for the dump ("float32", "bfloat16"; None: the model's own). The
  # manifest records the one used, so a dump is never resumed or indexed across dtypes.
  compute_dtype: str | None = None
  # Call widths are the calls' longest window rounded up to this (0: the platform's, 32 on an
  # accelerator, 16 on a CPU: `phrase_calls`); each width compiles once. Speed only: the vectors
  # differ by rounding at most, so a dump resumes at another multiple (the manifest's
  # `width_multiple` is that of the run that made it or finished it).
  width_multiple: int = 0
  # Dump-time filtering and coding (`dpjax.index.dump_codes`): tokens kept when a filter logit
  # reaches `filter_threshold` (None: all); `codec` ("": none) trained on `train_size` kept
  # tokens codes them; `vectors` False stores no float16 vectors (a codec's codes only).
  filter_threshold: float | None = None
  codec: str = ""
  vectors: bool = True
  train_size: int = 0


# The settings above that older dumps predate, at the values those dumps had: a manifest records
# them only when they differ (`kept_settings`), so that a dump of the defaults is unchanged.
KEPT_DEFAULTS = {"filter_threshold": None, "codec": "", "vectors": True, "train_size": 0}


def kept_settings(settings: dict) -> dict:
  """A dump's manifest settings with the dump-time filtering and coding ones at their defaults
  filled in (`KEPT_DEFAULTS`)."""
  return {**KEPT_DEFAULTS, **settings}


def dump_coding_files(record: dict) -> dict[str, str]:
  """The files of a dump's coding (name -> digest) its manifest's codec `record` names: the
  codec, and a residual or weighted one's means codec and weighting (`dpjax.index.residual`)."""
  return {DUMP_CODEC: record["sha"], **record.get("files", {})}


def window_settings(config: DumpConfig) -> dict:
  """The settings that decide which windows (so which vectors) a dump holds."""
  return {"max_seq_length": config.max_seq_length, "doc_stride": config.doc_stride,
          "include_title": config.include_title, "min_context": config.min_context}


def dump_windows(data: DataSettings, index: IndexSettings) -> dict:
  """`window_settings` as an experiment config gives them (`index.dump_*`, `data.*`)."""
  return {"max_seq_length": index.dump_max_seq_length or data.max_seq_length,
          "doc_stride": data.doc_stride, "include_title": data.include_title,
          "min_context": index.dump_min_context}


def dump_config(data: DataSettings, index: IndexSettings, model_dtype: str, mesh) -> DumpConfig:
  """The dump settings of an experiment config (`run.py dump`; a dump made with other ones is
  refused): its windows (`dump_windows`), batches rounded to `mesh`'s devices, computed in
  `index.dump_dtype` or else the model's `model_dtype`."""
  return DumpConfig(**dump_windows(data, index),
                    batch_size=round_to_devices(index.batch_size, mesh),
                    shard_passages=index.shard_passages,
                    width_multiple=index.dump_width_multiple,
                    compute_dtype=index.dump_dtype or model_dtype,
                    filter_threshold=index.dump_filter_threshold, codec=index.dump_codec,
                    vectors=index.dump_vectors,
                    # (a setting of the codec only: a dump without one is not refused by it)
                    train_size=index.train_size if index.dump_codec else 0)


def training_windows_config(data_config, batch_size: int) -> DumpConfig:
  """Dump settings with the windows the model is trained on (`data.*`): the in-training
  validation encodes its subcorpus in memory with them."""
  return DumpConfig(max_seq_length=data_config.max_seq_length,
                    doc_stride=data_config.doc_stride,
                    include_title=data_config.include_title, batch_size=batch_size)


def write_manifest(directory: pathlib.Path, manifest: dict) -> None:
  write_json(directory / MANIFEST, {**manifest, "format": FORMAT})


def load_manifest(directory: pathlib.Path) -> dict | None:
  """The manifest in `directory`, complete or not (None: none there); one of format 1 with its
  missing settings filled in (`LEGACY_SETTINGS`)."""
  if not (directory / MANIFEST).exists():
    return None
  manifest = read_json(directory / MANIFEST, DumpError,
                       "delete the dump's directory and dump again")
  if (isinstance(manifest, dict) and isinstance(manifest.get("settings"), dict)
      and manifest.get("format", 1) < FORMAT):
    manifest["settings"] = {**LEGACY_SETTINGS, **manifest["settings"]}
  return manifest


def read_manifest(directory: str | os.PathLike, *, rewriting_filter: bool = False) -> dict:
  """The manifest of a complete dump (DumpError when missing or incomplete; `rewriting_filter`:
  also one whose filter logits' rewrite was interrupted, for the rewrite that starts again)."""
  directory = pathlib.Path(directory)
  manifest = load_manifest(directory) if (directory / MANIFEST).is_file() else None
  if manifest is None:
    raise DumpError(f"{directory}: no {MANIFEST}: not a phrase dump (run `run.py dump`)")
  if not manifest.get("complete"):
    raise DumpError(f"{directory}: the dump is incomplete (a run was interrupted); run the "
                    "same dump command again to finish it")
  if manifest.get("filter_rewrite_incomplete") and not rewriting_filter:
    raise DumpError(f"{directory}: rewriting its filter logits was interrupted; run "
                    "`run.py filter` again")
  return manifest


def existing_manifest(out_dir: pathlib.Path, manifest: dict) -> dict | None:
  """The manifest of a dump already in `out_dir` (None if none), for a dump of `manifest`
  (`dump_phrases`) to resume or reuse; one of another model or settings is refused."""
  old = load_manifest(out_dir)
  if old is None:
    return None
  if old["fingerprint"] != manifest["fingerprint"]:
    raise DumpError(f"{out_dir} holds a dump of another model; use a new directory (or delete it)")
  settings = old["settings"]
  if settings != manifest["settings"]:
    differ = ", ".join(f"{k} {settings.get(k)!r} (now {v!r})"
                       for k, v in manifest["settings"].items() if settings.get(k) != v)
    raise DumpError(f"{out_dir} holds a dump with other settings: {differ}; use a new directory "
                    "(index.dump_name) or delete it")
  # (manifests from before these were recorded: not compared). A complete dump is not touched
  # again: its tokenization is its own (its serialisation may change with the library), but its
  # filter logits must be the workdir's head's.
  checked = (("filter_head", "another token filter head (filter_head.npz)"),) + (
      () if old.get("complete") else (("tokenizer", "another tokenizer"),))
  for key, what in checked:
    if key in old and old[key] != manifest[key]:
      raise DumpError(f"{out_dir} holds a dump made with {what} ({old[key]}, now "
                      f"{manifest[key]}); use a new directory (index.dump_name) or delete it")
  return old


def check_dump(manifest: dict, directory: pathlib.Path, *, windows: dict,
               corpus: Callable[[], list[str | os.PathLike]], fingerprint: str | None = None
               ) -> None:
  """Refuses a dump (its `manifest`) made by another phrase encoder than the one `fingerprint`
  names (`encoder_fingerprint`; None: not checked), or that is not of the configured corpus
  (`corpus()`'s files, called only when the manifest records its files' names and sizes) or
  `windows` (`dump_windows`): index, eval, search, mine, serve, QSFT and the token filter would
  otherwise use it without a word. Checked on the manifest alone, before any shard is read."""
  if fingerprint is not None and manifest.get("fingerprint") != fingerprint:
    raise DataError(f"{directory} was dumped by another model than this workdir's checkpoint "
                    "(phrase encoder fingerprints differ): dump the corpus again with this model "
                    "(`run.py dump` into a new index.dump_name)")
  recorded = manifest.get("corpus", {}).get("files")
  if recorded:
    files = [pathlib.Path(f) for f in corpus()]
    now = [(f.name, f.stat().st_size if f.is_file() else None) for f in files]
    then = [(pathlib.Path(f["path"]).name, f.get("bytes")) for f in recorded]
    if now != then:
      raise DataError(f"{directory} is a dump of another corpus "
                      f"({', '.join(n for n, _ in then)}; index.corpus gives "
                      f"{', '.join(n for n, _ in now)}, or their sizes differ): dump the corpus "
                      "into a new index.dump_name, or set index.corpus back")
  settings = {**LEGACY_SETTINGS, **manifest.get("settings", {})}
  differ = [f"{k} {settings.get(k)!r} (the config's {v!r})"
            for k, v in windows.items() if settings.get(k, v) != v]
  if differ:
    raise DataError(f"{directory} is a dump of other windows: {', '.join(differ)}; dump into a "
                    "new index.dump_name, or set data.* / index.dump_* back")


def check_index_of_dump(directory: pathlib.Path, index: dict, dump_directory: pathlib.Path,
                        dump: dict) -> None:
  """Refuses the index in `directory` (its manifest `index`) unless it was built from the dump
  of manifest `dump` as it is now (a DumpError saying to rebuild it)."""
  if (index["fingerprint"] != dump["fingerprint"]
      # (a compact index counts the tokens encoded, before a dump-time filter)
      or index.get("dump_tokens") not in (dump["num_tokens"], dump.get("context_tokens"))
      or index.get("dump_id", "") != dump.get("dump_id", "")):
    raise DumpError(f"{directory} was built from another dump than the one in "
                    f"{dump_directory} (or an older dump of it): rebuild it with "
                    "`run.py index`")
  if index.get("labels") not in ("token_id", "kept_rank"):  # (kept_rank: a compact index's)
    raise DumpError(f"{directory} was built by an older dpjax (faiss labels are not token ids); "
                    "rebuild it with `run.py index`")
  if index.get("filter_threshold") is not None and (index.get("filter_head")
                                                    != dump.get("filter_head")):
    raise DumpError(f"{directory} kept its tokens by the filter logits of another filter head "
                    "than the dump's now (`run.py filter` rewrote them): rebuild it with "
                    "`run.py index`")
