"""Checkpoints with Orbax's CheckpointManager: periodic saves, keep-N, resume from the workdir.

A save writes the whole train state (model parameters, optimizer state, pre-batch queue, step,
rng) and a small JSON record (data position, config) into a temporary directory that Orbax
renames into place only once complete, so a run killed mid-save leaves at most an unfinished
temporary directory, which is never restored (and is cleaned up by the next run).
"""
from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


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
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)),
                      metrics=metrics, force=True)
    self.manager.wait_until_finished()
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
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
    log.info("restored checkpoint %d from %s", step, self.directory)
    return restored["state"], restored["meta"]

  def close(self) -> None:
    self.manager.close()


def abstract_like(state: Any) -> Any:
  """Shape/dtype/sharding structs of a state, the restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)
