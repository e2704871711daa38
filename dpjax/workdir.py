"""A workdir's services for every program: where its data, corpus and dump are, and its trained
model loaded for inference (parameters only), with the token filter head and a searcher.

Layout of a workdir: `checkpoints/` (train), `checkpoints_best/` (validation), `checkpoints_qsft/`
(query-side fine-tuning), `<index.dump_name>/` (the dump and its `indexes/`), `filter_head.npz`
(`run.py filter`), reports (`results.json`, `open_eval_*.json`, ...).
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
from dpjax.index.dump import Dump, encoder_fingerprint
from dpjax.io import digest, save_npz_atomic, workdir_lock
from dpjax.index.sparse import SparseIndex
from dpjax.index.search import DensePhrases, PhraseIndex
from dpjax.models import model_for_data

log = logging.getLogger(__name__)
CHECKPOINTS = {"latest": "checkpoints", "best": "checkpoints_best", "qsft": "checkpoints_qsft"}
QSFT_METRIC = "em@1"  # what `checkpoints_qsft` keeps the best of
FILTER_HEAD = "filter_head.npz"  # the token filter head `run.py filter` trained
WORKDIR_LOCK = "workdir.lock"  # held by the `run.py` mode writing into the workdir (`writes_to`)


def writes_to(mode):
  """A `run.py` mode `mode(config, workdir, ...)` that writes into its workdir, run under the
  workdir's lock (`WORKDIR_LOCK`, held by process 0 of a job): one writer at a time, a second
  one refused at once naming the first one's pid and command (two dumps in one workdir removed
  each other's shards); the lock of a run that is gone is taken over with a warning."""
  @functools.wraps(mode)
  def run(config, workdir, *args, **kwargs):
    if not distributed.is_main():
      return mode(config, workdir, *args, **kwargs)
    pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
    with workdir_lock(pathlib.Path(workdir) / WORKDIR_LOCK, ""):
      return mode(config, workdir, *args, **kwargs)
  return run


def data_paths(config, workdir: pathlib.Path) -> dict:
  """The corpus files, evaluation questions and dump directory a config names for `workdir`."""
  files = data_files(config.data, workdir)
  # Default corpus: the data set's own (synthetic: corpus.json; SQuAD: train + dev paragraphs).
  corpus = list(config.index.corpus) or [str(files[k]) for k in ("corpus",) if k in files] or [
      str(files["train"]), str(files["dev"])]
  questions = config.index.questions or str(files["dev"])
  return {"corpus": corpus, "questions": questions,
          "dump": pathlib.Path(workdir) / config.index.dump_name}


def dump_windows(config) -> dict:
  """The dump settings that decide which windows (so which vectors) a dump holds, as the
  config gives them and a dump's manifest records them."""
  return {"max_seq_length": (config.index.get("dump_max_seq_length", 0)
                             or config.data.max_seq_length),
          "doc_stride": config.data.doc_stride, "include_title": config.data.include_title,
          "min_context": config.index.get("dump_min_context", 0)}


def check_dump_config(config, workdir: pathlib.Path, manifest: dict) -> None:
  """Refuses a dump that is not of the configured corpus (its files' names and sizes, as the
  manifest records them) or windows (`dump_windows`): `run.py dump` refuses to add to such a
  dump, and index, eval, search, mine and serve would otherwise use it without a word."""
  where = pathlib.Path(workdir) / config.index.dump_name
  recorded = manifest.get("corpus", {}).get("files")
  if recorded:
    files = [pathlib.Path(f) for f in data_paths(config, workdir)["corpus"]]
    now = [(f.name, f.stat().st_size if f.is_file() else None) for f in files]
    then = [(pathlib.Path(f["path"]).name, f.get("bytes")) for f in recorded]
    if now != then:
      raise DataError(f"{where} is a dump of another corpus ({', '.join(n for n, _ in then)}; "
                      f"index.corpus gives {', '.join(n for n, _ in now)}, or their sizes "
                      "differ): dump the corpus into a new index.dump_name, or set index.corpus "
                      "back")
  settings = {"min_context": 0, **manifest.get("settings", {})}
  differ = [f"{k} {settings.get(k)!r} (the config's {v!r})"
            for k, v in dump_windows(config).items() if settings.get(k, v) != v]
  if differ:
    raise DataError(f"{where} is a dump of other windows: {', '.join(differ)}; dump into a new "
                    "index.dump_name, or set data.* / index.dump_* back")


def check_dump_of(config, workdir: pathlib.Path, model, manifest: dict) -> None:
  """Refuses a dump that `model` (the workdir's checkpoint) did not make, or that is not of the
  configured corpus and windows (`check_dump_config`): for what reads the dump's vectors with
  the model's question encoders or filter head (QSFT, the token filter)."""
  if manifest.get("fingerprint") != encoder_fingerprint(model):
    raise DataError(f"{pathlib.Path(workdir) / config.index.dump_name} was dumped by another "
                    "model than this workdir's checkpoint (phrase encoder fingerprints differ): "
                    "dump the corpus again with this model (`run.py dump` into a new "
                    "index.dump_name)")
  check_dump_config(config, workdir, manifest)


def filter_head_digest(kernel, bias) -> dict:
  """What a dump's manifest records of a separately trained filter head (`filter_head`)."""
  return {"file": FILTER_HEAD, "sha": digest(np.asarray(kernel, np.float32),
                                             np.asarray(bias, np.float32))}


def save_filter_head(workdir: pathlib.Path, kernel, bias) -> None:
  """Writes `run.py filter`'s head with its digest (`filter_head_digest`), which
  `read_filter_head` checks."""
  save_npz_atomic(pathlib.Path(workdir) / FILTER_HEAD, kernel=kernel, bias=bias,
                  sha=np.array(filter_head_digest(kernel, bias)["sha"]))


def read_filter_head(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  """(kernel, bias) of a saved filter head; a damaged file, or one whose arrays differ from the
  digest written with them, is a DataError naming it (one saved without a digest: unchecked)."""
  redo = "run `run.py filter` again (or delete it to use the jointly trained filter head)"
  try:
    with np.load(path) as saved:
      kernel, bias = saved["kernel"].astype(np.float32), saved["bias"].astype(np.float32)
      sha = str(saved["sha"]) if "sha" in saved.files else None
  except Exception as e:  # a damaged file (zip, pickle or key errors)
    raise DataError(f"{path}: unreadable ({type(e).__name__}: {e}); {redo}") from None
  if sha is not None and filter_head_digest(kernel, bias)["sha"] != sha:
    raise DataError(f"{path}: its arrays differ from the digest written with them; {redo}")
  return kernel, bias


def restore_model(config, workdir: pathlib.Path, step: int | None = None, *,
                  allow_untrained: bool | None = None, verify: bool = False):
  """(model, step): the configured model with the parameters of the latest checkpoint in
  `workdir` (or of the best one by validation, `eval.checkpoint=best`, of QSFT's, `qsft`, or of
  checkpoint `step`). A workdir without checkpoints is refused (a DataError) unless
  `allow_untrained` (default: `eval.allow_untrained`): then the untrained model, step None.
  `verify`: the checkpoint's files are checked against their digests (`restore_params`)."""
  which = config.eval.get("checkpoint", "latest")
  if which not in CHECKPOINTS:
    raise ConfigError(f"eval.checkpoint must be one of {sorted(CHECKPOINTS)}, not {which!r}")
  checkpoints = pathlib.Path(workdir) / CHECKPOINTS[which]
  if which != "latest" and not checkpoints.is_dir():
    raise DataError(f"{checkpoints}: no {which} checkpoint (train with validation.every_steps, "
                    "or run `run.py qsft`)")
  if not checkpoints.is_dir():
    if allow_untrained is None:
      allow_untrained = config.eval.get("allow_untrained", False)
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
  path = pathlib.Path(workdir) / FILTER_HEAD
  if not path.is_file():
    return None
  kernel, bias = read_filter_head(path)
  head = nnx.state(model.filter_head, nnx.Param)
  if kernel.shape != head["kernel"][...].shape or bias.shape != head["bias"][...].shape:
    raise DataError(f"{path}: a filter head of another model (kernel {kernel.shape}, the "
                    f"model's {head['kernel'][...].shape}); run `run.py filter` again")
  head["kernel"].set_value(kernel)
  head["bias"].set_value(bias)
  nnx.update(model.filter_head, head)
  log.info("token filter head from %s", path)
  return filter_head_digest(kernel, bias)


def load_searcher(config, workdir: pathlib.Path, index_name: str | None = None, *,
                  verify: bool = False):
  """(DensePhrases over the workdir's index `index_name` (default index.search_index), the
  model's checkpoint step). `verify`: the checkpoint's, dump's and index's files are checked
  against the digests recorded when they were written (serve and eval: `index.verify`)."""
  workdir = pathlib.Path(workdir)
  model, step = restore_model(config, workdir, verify=verify)
  index = PhraseIndex(workdir / config.index.dump_name, index_name or config.index.search_index,
                      nprobe=config.index.nprobe,
                      search_device=config.index.get("search_device", "auto"), verify=verify)
  check_dump_config(config, workdir, index.dump.manifest)
  index.merge_spans = config.index.get("merge_spans", True)
  if config.index.get("sparse", False):
    index.use_sparse(SparseIndex(index.dump.directory, index.dump.manifest, verify=verify),
                     config.index.sparse_weight, passages=config.index.sparse_passages)
  searcher = DensePhrases(model, index, Tokenizer.from_pretrained(config.model.tokenizer),
                          max_query_length=config.data.max_query_length,
                          batch_size=config.index.batch_size)
  return searcher, step


def open_workdir(config_spec: str, workdir: str | pathlib.Path, overrides: Sequence[str] = ()):
  """What analysis code starts from: `(config, workdir, dump, questions)` of a workdir that has
  a complete dump (notebooks, `experiments/benchmarks/*`)."""
  config = load_config(config_spec, overrides)
  workdir = pathlib.Path(workdir)
  paths = data_paths(config, workdir)
  return config, workdir, Dump.load(paths["dump"]), read_questions(paths["questions"])
