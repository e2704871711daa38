"""A workdir's services for every program: where its data, corpus and dump are, and its trained
model loaded for inference (parameters only), with the token filter head and a searcher.

The workdir's layout is `dpjax.workdir.Workdir`'s.
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib

import numpy as np
from flax import nnx

from dpjax.checkpoint import best_checkpoint_step, restore_params
from dpjax.data import Tokenizer, data_files
from dpjax.errors import ConfigError, DataError
from dpjax.index.dump_reader import Dump
from dpjax.index.hybrid import Hybrid
from dpjax.index.manifest import check_dump, dump_windows, encoder_fingerprint, read_manifest
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.search import PhraseSearcher
from dpjax.index.sparse import SparseIndex
from dpjax.io import digest, save_npz_atomic
from dpjax.workdir import CHECKPOINTS, FILTER_HEAD, Workdir
from dpjax.models import model_for_data
from dpjax.settings import DataSettings, EvalSettings, IndexSettings, ModelSettings

log = logging.getLogger(__name__)
QSFT_METRIC = "em@1"  # what `checkpoints_qsft` keeps the best of


def data_paths(data: DataSettings, index: IndexSettings, workdir: pathlib.Path) -> dict:
  """The corpus files, evaluation questions and dump directory the sections name for
  `workdir`."""
  files = data_files(data, workdir)
  # Default corpus: the data set's own (synthetic: corpus.json; SQuAD: train + dev paragraphs).
  corpus = list(index.corpus) or [str(files[k]) for k in ("corpus",) if k in files] or [
      str(files["train"]), str(files["dev"])]
  questions = index.questions or str(files["dev"])
  return {"corpus": corpus, "questions": questions, "dump": Workdir(workdir).dump(index.dump_name)}


def checked_dump(data: DataSettings, index: IndexSettings, workdir: pathlib.Path,
                 model=None) -> dict:
  """The manifest of the workdir's complete dump (`index.dump_name`), refused (`check_dump`)
  unless it is of the configured corpus and windows and, given `model` (for what reads the
  dump's vectors with the model's question encoders or filter head: QSFT, the token filter),
  made by its phrase encoder. Read and checked before any shard is: index, eval, search, mine,
  serve, QSFT and the token filter would otherwise use another dump without a word."""
  dump = Workdir(workdir).dump(index.dump_name)
  manifest = read_manifest(dump)
  check_dump(manifest, dump, windows=dump_windows(data, index),
             corpus=lambda: data_paths(data, index, workdir)["corpus"],
             fingerprint=None if model is None else encoder_fingerprint(model))
  return manifest


def filter_head_digest(kernel, bias) -> dict:
  """What a dump's manifest records of a separately trained filter head (`filter_head`)."""
  return {"file": FILTER_HEAD, "sha": digest(np.asarray(kernel, np.float32),
                                             np.asarray(bias, np.float32))}


def save_filter_head(workdir: pathlib.Path, kernel, bias) -> dict:
  """Writes `run.py filter`'s head with its digest (`filter_head_digest`, returned), which
  `read_filter_head` checks."""
  record = filter_head_digest(kernel, bias)
  save_npz_atomic(Workdir(workdir).filter_head, kernel=kernel, bias=bias,
                  sha=np.array(record["sha"]))
  return record


def read_filter_head(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  """(kernel, bias) of a saved filter head; a damaged file, or one whose arrays differ from the
  digest written with them, is a DataError naming it (one saved without a digest: unchecked)."""
  return _read_filter_head(path)[:2]


def _read_filter_head(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray, dict]:
  """`read_filter_head`'s (kernel, bias) and their `filter_head_digest` (hashed once)."""
  redo = "run `run.py filter` again (or delete it to use the jointly trained filter head)"
  try:
    with np.load(path) as saved:
      kernel, bias = saved["kernel"].astype(np.float32), saved["bias"].astype(np.float32)
      sha = str(saved["sha"]) if "sha" in saved.files else None
  except Exception as e:  # a damaged file (zip, pickle or key errors)
    raise DataError(f"{path}: unreadable ({type(e).__name__}: {e}); {redo}") from None
  record = filter_head_digest(kernel, bias)
  if sha is not None and record["sha"] != sha:
    raise DataError(f"{path}: its arrays differ from the digest written with them; {redo}")
  return kernel, bias, record


def restore_model(model: ModelSettings, data: DataSettings, evaluation: EvalSettings,
                  workdir: pathlib.Path, step: int | None = None, *, best_metric: str = "em@1",
                  allow_untrained: bool | None = None, verify: bool = False):
  """(model, step): the configured model with the parameters of the latest checkpoint in
  `workdir` (or of the best one by validation's `best_metric`, `eval.checkpoint=best`, of
  QSFT's, `qsft`, or of checkpoint `step`). A workdir without checkpoints is refused (a
  DataError) unless `allow_untrained` (default: `eval.allow_untrained`): then the untrained
  model, step None. `verify`: the checkpoint's files are checked against their digests
  (`restore_params`)."""
  which = evaluation.checkpoint
  if which not in CHECKPOINTS:
    raise ConfigError(f"eval.checkpoint must be one of {sorted(CHECKPOINTS)}, not {which!r}")
  checkpoints = Workdir(workdir).checkpoints(which)
  if which != "latest" and not checkpoints.is_dir():
    raise DataError(f"{checkpoints}: no {which} checkpoint (train with validation.every_steps, "
                    "or run `run.py qsft`)")
  if not checkpoints.is_dir():
    if allow_untrained is None:
      allow_untrained = evaluation.allow_untrained
    weights = model.name if model.init == "pretrained" else "random"
    if not allow_untrained:
      raise DataError(f"{workdir} has no checkpoints: train into it first (or check --workdir); "
                      f"--set eval.allow_untrained=True uses the untrained {weights} weights")
    log.warning("%s has no checkpoints: using the untrained %s weights", workdir, weights)
    return model_for_data(model, data), None
  built = model_for_data(model, data)
  if step is None and which != "latest":  # the best one kept, not the newest one on disk
    step = best_checkpoint_step(checkpoints, best_metric if which == "best" else QSFT_METRIC)
  restored = restore_params(checkpoints, built, step, verify=verify)  # DataError: no such step
  if restored is None:
    raise DataError(f"{checkpoints}: no complete checkpoint to load")
  return built, restored


def apply_filter_head(model, workdir: pathlib.Path) -> dict | None:
  """Puts the head `run.py filter` trained (workdir/filter_head.npz) into the model, if any;
  returns its `filter_head_digest` (None: the model's own, jointly trained head)."""
  path = Workdir(workdir).filter_head
  if not path.is_file():
    return None
  kernel, bias, record = _read_filter_head(path)
  head = nnx.state(model.filter_head, nnx.Param)
  if kernel.shape != head["kernel"][...].shape or bias.shape != head["bias"][...].shape:
    raise DataError(f"{path}: a filter head of another model (kernel {kernel.shape}, the "
                    f"model's {head['kernel'][...].shape}); run `run.py filter` again")
  head["kernel"].set_value(kernel)
  head["bias"].set_value(bias)
  nnx.update(model.filter_head, head)
  log.info("token filter head from %s", path)
  return record


def search_options(index: IndexSettings, dump: Dump, *, verify: bool = False) -> dict:
  """The index section's search options for `PhraseIndex(..., **options)` over `dump`: merged
  spans, and hybrid search with the dump's BM25 index (`index.sparse`)."""
  hybrid = None
  if index.sparse:
    hybrid = Hybrid.of(SparseIndex(dump.directory, dump.manifest, verify=verify),
                       index.sparse_weight, index.sparse_sentence_weight,
                       passages=index.sparse_passages)
  return {"merge_spans": index.merge_spans, "hybrid": hybrid}


def reread_scorer(evaluation: EvalSettings, index: IndexSettings) -> str | None:
  """The checkpoint whose question encoder scores re-read spans when it is not the one that
  ranks the candidates (`index.reread_checkpoint` other than eval.checkpoint), else None."""
  if not index.reread or index.reread_checkpoint in (None, evaluation.checkpoint):
    return None
  return index.reread_checkpoint


def describe_search(index: PhraseIndex) -> str:
  """Which search an index runs, for the logs: dense, or hybrid with its weights."""
  found = index.hybrid
  reread = ("" if index.reread is None else
            f", the top {index.reread.passages} passages re-read"
            + ("" if index.reread.margin is None else
               f" (those within {index.reread.margin:g} of the best span)")
            + ("" if index.reread.questions is None else
               ", their spans scored by another question encoder"))
  if found is None or not found.active:
    return ("dense phrase search" + ("" if found is None else " (hybrid weights 0 and 0)")
            + reread)
  return (f"hybrid search (dense + {found.weight:g} x passage BM25 + {found.sentence_weight:g} "
          f"x sentence BM25, top {found.passages} BM25 passages{reread})")


def load_searcher(model: ModelSettings, data: DataSettings, evaluation: EvalSettings,
                  index: IndexSettings, workdir: pathlib.Path, index_name: str | None = None, *,
                  best_metric: str = "em@1", verify: bool = False):
  """(PhraseSearcher over the workdir's index `index_name` (default index.search_index), the
  model's checkpoint step). `verify`: the checkpoint's, dump's and index's files are checked
  against the digests recorded when they were written (serve and eval: `index.verify`)."""
  workdir = Workdir(workdir)
  encoder, step = restore_model(model, data, evaluation, workdir, best_metric=best_metric,
                                verify=verify)
  scorer, which = None, reread_scorer(evaluation, index)
  if which is not None:
    scorer, scorer_step = restore_model(model, data,
                                        dataclasses.replace(evaluation, checkpoint=which),
                                        workdir, best_metric=best_metric, allow_untrained=False,
                                        verify=verify)
    log.info("re-read spans scored by the question encoder of the %s checkpoint (step %s)",
             which, scorer_step)
  checked_dump(data, index, workdir)
  # From the dump's folder: a compact index reads the dump's manifest only (it holds its own
  # passages and codes).
  phrases = PhraseIndex(workdir.dump(index.dump_name), index_name or index.search_index,
                        nprobe=index.nprobe, search_device=index.search_device, verify=verify)
  phrases = phrases.with_options(**search_options(index, phrases.dump, verify=verify))
  searcher = PhraseSearcher(encoder, phrases, Tokenizer.from_pretrained(model.tokenizer),
                            max_query_length=data.max_query_length, batch_size=index.batch_size,
                            reread=index.reread, reread_margin=index.reread_margin,
                            reread_window=index.reread_window, reread_model=scorer)
  log.info("search: %s over index %s of %s", describe_search(searcher.index),
           phrases.manifest["spec"], phrases.dump.directory)
  return searcher, step
