"""Checkpoints with Orbax's CheckpointManager: periodic saves, keep-N, resume from the workdir.

A save writes the whole train state (model parameters, optimizer state, pre-batch queue, step,
rng) and a small JSON record (data position, config) into a temporary directory that Orbax
renames into place only once complete, so a run killed mid-save leaves at most an unfinished
temporary directory, which is never restored (and is cleaned up by the next run). Then the size
and digest of every file of the step are recorded (`CHECKSUMS`): restores check the sizes, and
`run.py verify` and serve/eval the contents (Orbax does not notice a zeroed block of an array).
"""
from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from dpjax.errors import DataError
from dpjax.io import checksum_problems, folder_checksums, read_json, refuse_damage, write_json

log = logging.getLogger(__name__)
CHECKSUMS = "dpjax_checksums.json"  # in a step's folder: its other files' sizes and digests


class Checkpointer:
  """Saves and restores `(state, meta)` pairs under `directory`."""

  def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, best_metric: str = ""):
    """Keeps the `keep` latest checkpoints, or with `best_metric` the `keep` best by that metric
    (higher is better; `save` then needs `metrics`)."""
    self.directory = pathlib.Path(directory).absolute()
    self.best_metric = best_metric
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=False,
        best_fn=(lambda metrics: metrics[best_metric]) if best_metric else None,
        best_mode="max", keep_checkpoints_without_metrics=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def save(self, step: int, state: Any, meta: dict, metrics: dict | None = None) -> None:
    if self.best_metric and (not metrics or self.best_metric not in metrics):
      raise ValueError(f"a best-{self.best_metric} checkpoint needs that metric, got {metrics}")
    if step in self.manager.all_steps():
      if metrics is not None and self.manager.metrics(step) == metrics:
        # saved before a kill and redone by the exact resume: the same state
        log.info("checkpoint %d is in %s already (saved before the resume): kept", step,
                 self.directory)
        return
      log.warning("%s: replacing checkpoint %d, of another run", self.directory, step)
      self.manager.delete(step)
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)),
                      metrics=metrics, force=True)
    self.manager.wait_until_finished()
    if jax.process_index() == 0:  # every process's files are in place once the save returns
      record_checkpoint_files(self.directory / str(step))
    log.info("saved checkpoint %d to %s", step, self.directory)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def best_step(self) -> int | None:
    return self.manager.best_step() if self.best_metric else self.manager.latest_step()

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
    """Restores `step` (default: the latest complete one) into the shapes/shardings given.

    Returns:
      (state, meta), or None when the directory holds no complete checkpoint.
    """
    step = self.manager.latest_step() if step is None else step
    if step is None:
      return None
    check_checkpoint(self.directory / str(step))
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    except Exception as e:  # a damaged or foreign checkpoint: name it, do not guess
      raise DataError(f"{self.directory / str(step)}: checkpoint cannot be restored "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); delete it to "
                      "resume from an earlier one") from None
    log.info("restored checkpoint %d from %s", step, self.directory)
    return restored["state"], restored["meta"]

  def close(self) -> None:
    self.manager.close()


def record_checkpoint_files(step_dir: pathlib.Path) -> None:
  """Records the size and digest of every file of a saved step (`CHECKSUMS`)."""
  write_json(step_dir / CHECKSUMS, folder_checksums(step_dir, skip=[CHECKSUMS]))


def checkpoint_rerun(step_dir: pathlib.Path) -> str:
  return (f"delete {step_dir} (an earlier checkpoint is then used, and `run.py train` resumes "
          "from it)")


def checkpoint_problems(step_dir: pathlib.Path, *, contents: bool,
                        reuse_stamps: bool = True) -> list[str] | None:
  """What is wrong with a step's files against the sizes and (`contents`) digests recorded when
  it was saved (`checksum_problems`, which `reuse_stamps` passes to); None when none were (a
  checkpoint of an older dpjax)."""
  if not (step_dir / CHECKSUMS).is_file():
    return None
  recorded = read_json(step_dir / CHECKSUMS, DataError, checkpoint_rerun(step_dir))
  return checksum_problems(step_dir, recorded, contents=contents, reuse_stamps=reuse_stamps)


def check_checkpoint(step_dir: pathlib.Path, *, contents: bool = False) -> None:
  """Refuses a checkpoint step whose files are missing, of other sizes or (`contents`) of other
  bytes than when saved: a DataError naming the first such file."""
  problems = checkpoint_problems(step_dir, contents=contents)
  refuse_damage(problems, DataError, "checkpoint", checkpoint_rerun(step_dir))
  if problems is None:
    log.info("%s: a checkpoint saved before digests were recorded: unverified", step_dir)


def abstract_like(state: Any) -> Any:
  """Shape/dtype/sharding structs of a state, the restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)


def best_checkpoint_step(directory: str | pathlib.Path, metric: str) -> int | None:
  """The step of the best checkpoint under a directory of best-metric checkpoints
  (`Checkpointer(best_metric=)`), by the metric they were kept by (the one each step recorded;
  `metric` if they recorded several). Not the newest: a worse step is saved before it is
  deleted, and a run killed in between leaves both."""
  recorded = set()
  for step in checkpoint_steps(directory):
    path = pathlib.Path(directory) / str(step) / "metrics" / "metrics"  # Orbax's metrics item
    recorded |= set(json.loads(path.read_text())) if path.is_file() else set()
  if len(recorded) == 1:  # e.g. validation.metric=mrr@20 in the run that kept them
    metric = recorded.pop()
  checkpointer = Checkpointer(directory, keep=1, best_metric=metric)
  try:
    return checkpointer.best_step()
  except KeyError:
    raise DataError(f"{directory}: its checkpoints were kept by another metric than {metric!r} "
                    "(validation.metric)") from None
  finally:
    checkpointer.close()


def checkpoint_steps(directory: str | pathlib.Path) -> list[int]:
  """The steps of the complete checkpoints under `directory` (empty when there is none)."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and (p / "state").is_dir())


def _shapes(tree) -> dict[str, tuple]:
  return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_shapes(checkpoint: pathlib.Path, target: dict) -> None:
  """Refuses a checkpoint whose parameters are not the model's, name for name and shape for
  shape: a partial restore would keep the model's untrained values for parameters the
  checkpoint lacks (a layer more), drop the ones it has beyond the model's (a layer less) and
  put in arrays of the checkpoint's shapes (another vocabulary), all silently."""
  try:
    # The handler's, not a Checkpointer's: that also reads step metadata from the item's folder
    # (none there: it is the step's) and warns of its absence on every restore.
    stored = ocp.PyTreeCheckpointHandler().metadata(checkpoint / "state")
    stored = getattr(stored, "item_metadata", stored)
    stored = _shapes(getattr(stored, "tree", stored)["params"])
  except Exception as e:  # an Orbax whose metadata reads otherwise: `restore_params` checks the
    # shapes it restored (not parameters the checkpoint lacks: warned here)
    log.warning("%s: parameter shapes not checked before restoring (%s: %s)", checkpoint,
                type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
    return
  model = _shapes(target)
  problems = ([f"{k} missing" for k in model if k not in stored]
              + [f"{k} not in the model" for k in stored if k not in model]
              + [f"{k} {stored[k]} (the model's {model[k]})" for k in model
                 if k in stored and stored[k] != model[k]])
  if problems:
    raise DataError(f"{checkpoint}: a checkpoint of another model than the configured one "
                    f"({len(problems)} parameters differ: {'; '.join(problems[:4])}); check "
                    "--config and its --set model.* overrides against the run that wrote it")


def restore_params(directory: str | pathlib.Path, model, step: int | None = None, *,
                   verify: bool = False) -> int | None:
  """Puts the parameters of checkpoint `step` (default: the latest) under `directory` into
  `model`, reading nothing else of the train state (no optimizer or queue is built or read).
  The step's file sizes are checked against those recorded at its save, with `verify` their
  contents too (`check_checkpoint`).

  Returns the step restored, or None when the directory holds no complete checkpoint.
  """
  directory = pathlib.Path(directory).absolute()
  steps = checkpoint_steps(directory)
  if not steps:
    return None
  step = steps[-1] if step is None else step
  if step not in steps:
    raise DataError(f"{directory}: no checkpoint of step {step} (there are {steps})")
  check_checkpoint(directory / str(step), contents=verify)
  params = nnx.state(model, nnx.Param)
  # A checkpoint holds each parameter as {"value": array} (the NNX variable's state).
  target = {"params": jax.tree.map(lambda x: {"value": np.asarray(x)}, nnx.to_pure_dict(params))}
  _check_shapes(directory / str(step), target["params"])
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      restored = checkpointer.restore(directory / str(step) / "state",
                                      args=ocp.args.PyTreeRestore(item=target,
                                                                  restore_args=restore_args,
                                                                  partial_restore=True))
  except Exception as e:  # a damaged checkpoint, or one of another model
    raise DataError(f"{directory / str(step)}: parameters cannot be restored "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
  got, want = _shapes(restored["params"]), _shapes(target["params"])
  if got != want:
    differ = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
    raise DataError(f"{directory / str(step)}: a checkpoint of another model than the configured "
                    f"one (parameters {differ[:4]} differ)")
  # As device arrays: numpy parameters would be copied to the device at every jitted call
  # (results/code_measurements.md).
  values = jax.tree.map(lambda leaf: jnp.asarray(leaf["value"]), restored["params"],
                        is_leaf=lambda x: isinstance(x, dict) and set(x) == {"value"})
  nnx.replace_by_pure_dict(params, values)
  nnx.update(model, params)
  log.info("restored the parameters of checkpoint %d from %s", step, directory)
  return step
