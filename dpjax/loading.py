"""A workdir's services for every program: where its data, corpus and dump are, and its trained
model loaded for inference (parameters only), with the token filter head and a searcher.

The workdir's layout is `dpjax.workdir.Workdir`'s.
"""
from __future__ import annotations

import functools
import logging
import pathlib
from typing import Sequence

import numpy as np
from flax import nnx

from dpjax import distributed
from dpjax.checkpoint import best_checkpoint_step, restore_params
from dpjax.config import load_config
from dpjax.data import Tokenizer, data_files
from dpjax.data.questions import read_questions
from dpjax.errors import ConfigError, DataError
from dpjax.index.dump_reader import Dump
from dpjax.index.hybrid import Hybrid
from dpjax.index.manifest import check_dump, dump_windows, encoder_fingerprint, read_manifest
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.search import PhraseSearcher
from dpjax.index.sparse import SparseIndex
from dpjax.io import digest, save_npz_atomic, workdir_lock
from dpjax.workdir import CHECKPOINTS, FILTER_HEAD, Workdir
from dpjax.models import model_for_data

log = logging.getLogger(__name__)
QSFT_METRIC = "em@1"  # what `checkpoints_qsft` keeps the best of


def writes_to(mode):
  """A `run.py` mode `mode(config, workdir, ...)` that writes into its workdir, run under the
  workdir's lock (`Workdir.lock`, held by process 0 of a job): one writer at a time, a second
  one refused at once naming the first one's pid and command (two dumps in one workdir removed
  each other's shards); the lock of a run that is gone is taken over with a warning."""
  @functools.wraps(mode)
  def run(config, workdir, *args, **kwargs):
    workdir = Workdir(workdir)
    if not distributed.is_main():
      return mode(config, workdir, *args, **kwargs)
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
      with workdir_lock(workdir.lock, ""):
        return mode(config, workdir, *args, **kwargs)
    except BaseException:
      if created and workdir.is_dir() and not any(workdir.iterdir()):
        workdir.rmdir()  # a refused run in a mistyped workdir leaves no empty folder behind
      raise
  return run


def data_paths(config, workdir: pathlib.Path) -> dict:
  """The corpus files, evaluation questions and dump directory a config names for `workdir`."""
  files = data_files(config.data, workdir)
  # Default corpus: the data set's own (synthetic: corpus.json; SQuAD: train + dev paragraphs).
  corpus = list(config.index.corpus) or [str(files[k]) for k in ("corpus",) if k in files] or [
      str(files["train"]), str(files["dev"])]
  questions = config.index.questions or str(files["dev"])
  return {"corpus": corpus, "questions": questions,
          "dump": Workdir(workdir).dump(config.index.dump_name)}


def checked_dump(config, workdir: pathlib.Path, model=None) -> dict:
  """The manifest of the workdir's complete dump (`index.dump_name`), refused (`check_dump`)
  unless it is of the configured corpus and windows and, given `model` (for what reads the
  dump's vectors with the model's question encoders or filter head: QSFT, the token filter),
  made by its phrase encoder. Read and checked before any shard is: index, eval, search, mine,
  serve, QSFT and the token filter would otherwise use another dump without a word."""
  dump = Workdir(workdir).dump(config.index.dump_name)
  manifest = read_manifest(dump)
  check_dump(manifest, dump, windows=dump_windows(config),
             corpus=lambda: data_paths(config, workdir)["corpus"],
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


def restore_model(config, workdir: pathlib.Path, step: int | None = None, *,
                  allow_untrained: bool | None = None, verify: bool = False):
  """(model, step): the configured model with the parameters of the latest checkpoint in
  `workdir` (or of the best one by validation, `eval.checkpoint=best`, of QSFT's, `qsft`, or of
  checkpoint `step`). A workdir without checkpoints is refused (a DataError) unless
  `allow_untrained` (default: `eval.allow_untrained`): then the untrained model, step None.
  `verify`: the checkpoint's files are checked against their digests (`restore_params`)."""
  which = config.eval.checkpoint
  if which not in CHECKPOINTS:
    raise ConfigError(f"eval.checkpoint must be one of {sorted(CHECKPOINTS)}, not {which!r}")
  checkpoints = Workdir(workdir).checkpoints(which)
  if which != "latest" and not checkpoints.is_dir():
    raise DataError(f"{checkpoints}: no {which} checkpoint (train with validation.every_steps, "
                    "or run `run.py qsft`)")
  if not checkpoints.is_dir():
    if allow_untrained is None:
      allow_untrained = config.eval.allow_untrained
    weights = config.model.name if config.model.init == "pretrained" else "random"
    if not allow_untrained:
      raise DataError(f"{workdir} has no checkpoints: train into it first (or check --workdir); "
                      f"--set eval.allow_untrained=True uses the untrained {weights} weights")
    log.warning("%s has no checkpoints: using the untrained %s weights", workdir, weights)
    return model_for_data(config), None
  model = model_for_data(config)
  if step is None and which != "latest":  # the best one kept, not the newest one on disk
    step = best_checkpoint_step(checkpoints, config.validation.metric if which == "best"
                                else QSFT_METRIC)
  restored = restore_params(checkpoints, model, step, verify=verify)  # DataError: no such step
  if restored is None:
    raise DataError(f"{checkpoints}: no complete checkpoint to load")
  return model, restored


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


def search_options(config, dump: Dump, *, verify: bool = False) -> dict:
  """The config's search options for `PhraseIndex(..., **options)` over `dump`: merged spans,
  and hybrid search with the dump's BM25 index (`index.sparse`)."""
  hybrid = None
  if config.index.sparse:
    hybrid = Hybrid.of(SparseIndex(dump.directory, dump.manifest, verify=verify),
                       config.index.sparse_weight, config.index.sparse_sentence_weight,
                       passages=config.index.sparse_passages)
  return {"merge_spans": config.index.merge_spans, "hybrid": hybrid}


def describe_search(index: PhraseIndex) -> str:
  """Which search an index runs, for the logs: dense, or hybrid with its weights."""
  found = index.hybrid
  if found is None or not found.active:
    return "dense phrase search" + ("" if found is None else " (hybrid weights 0 and 0)")
  return (f"hybrid search (dense + {found.weight:g} x passage BM25 + {found.sentence_weight:g} "
          f"x sentence BM25, top {found.passages} BM25 passages)")


def load_searcher(config, workdir: pathlib.Path, index_name: str | None = None, *,
                  verify: bool = False):
  """(PhraseSearcher over the workdir's index `index_name` (default index.search_index), the
  model's checkpoint step). `verify`: the checkpoint's, dump's and index's files are checked
  against the digests recorded when they were written (serve and eval: `index.verify`)."""
  workdir = Workdir(workdir)
  model, step = restore_model(config, workdir, verify=verify)
  checked_dump(config, workdir)
  dump = Dump.load(workdir.dump(config.index.dump_name), verify=verify)
  index = PhraseIndex(dump, index_name or config.index.search_index, nprobe=config.index.nprobe,
                      search_device=config.index.search_device, verify=verify,
                      **search_options(config, dump, verify=verify))
  log.info("search: %s over index %s of %s", describe_search(index), index.manifest["spec"],
           dump.directory)
  searcher = PhraseSearcher(model, index, Tokenizer.from_pretrained(config.model.tokenizer),
                          max_query_length=config.data.max_query_length,
                          batch_size=config.index.batch_size)
  return searcher, step


def open_workdir(config_spec: str, workdir: str | pathlib.Path, overrides: Sequence[str] = ()):
  """What analysis code starts from: `(config, workdir, dump, questions)` of a workdir that has
  a complete dump (notebooks, `experiments/benchmarks/*`)."""
  config = load_config(config_spec, overrides)
  workdir = Workdir(workdir)
  paths = data_paths(config, workdir)
  return config, workdir, Dump.load(paths["dump"]), read_questions(paths["questions"])
