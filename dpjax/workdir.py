"""A workdir's layout: where every `run.py` mode reads and writes (`Workdir`).

The command line builds one `Workdir` (`config.run_in_workdir`) and passes it to the mode; a mode
called from a script or a test with a path makes one of it (`Workdir(path)`).

  <workdir>/
    checkpoints/  checkpoints_best/  checkpoints_qsft/   checkpoints by kind (`CHECKPOINTS`)
    metrics.jsonl  results.json  rc_predictions.json    training log and final RC scores
    tensorboard/<run>/                                   the logs' scalars as TensorBoard events
    <index.dump_name>/  <index.dump_name>/indexes/       the dump and its indexes
    filter_head.npz  filter_results.json                `run.py filter`'s head and sweep
    subcorpora/  teacher/  qsft_metrics.jsonl  open_eval_*.json ...   the other modes' outputs
"""
from __future__ import annotations

import pathlib

# eval.checkpoint -> the folder of that kind of checkpoint: train's latest, validation's best,
# query-side fine-tuning's best.
CHECKPOINTS = {"latest": "checkpoints", "best": "checkpoints_best", "qsft": "checkpoints_qsft"}
FILTER_HEAD = "filter_head.npz"  # the token filter head `run.py filter` trained
WORKDIR_LOCK = "workdir.lock"  # held by the `run.py` mode writing into the workdir
TEACHER = "teacher"  # the cross-encoder teacher's own workdir, inside this one
TENSORBOARD = "tensorboard"  # beside each metrics file: a folder of event files per run


class Workdir(type(pathlib.Path())):
  """A workdir: a path (`workdir / name` as any path), with the places of what the modes write.
  The teacher's workdir (`teacher`) is laid out the same way."""

  def checkpoints(self, kind: str = "latest") -> pathlib.Path:
    """The checkpoints of `kind` (`CHECKPOINTS`: latest, best, qsft)."""
    return pathlib.Path(self, CHECKPOINTS[kind])

  def dump(self, name: str) -> pathlib.Path:
    """The dump `name` (`index.dump_name`)."""
    return pathlib.Path(self, name)

  def indexes(self, name: str) -> pathlib.Path:
    """The folder of dump `name`'s indexes (one folder each)."""
    return self.dump(name) / "indexes"

  def report(self, name: str) -> pathlib.Path:
    """A mode's report or output file (`open_eval_Flat.json`, `qsft_results.json`, ...)."""
    return pathlib.Path(self, name)

  @property
  def metrics(self) -> pathlib.Path:
    return pathlib.Path(self, "metrics.jsonl")

  @property
  def tensorboard(self) -> pathlib.Path:
    """TensorBoard's `--logdir`: a run folder per metrics file (`tensorboard_run`)."""
    return pathlib.Path(self, TENSORBOARD)

  @property
  def results(self) -> pathlib.Path:
    return pathlib.Path(self, "results.json")

  @property
  def filter_head(self) -> pathlib.Path:
    return pathlib.Path(self, FILTER_HEAD)

  @property
  def lock(self) -> pathlib.Path:
    return pathlib.Path(self, WORKDIR_LOCK)

  @property
  def subcorpora(self) -> pathlib.Path:
    return pathlib.Path(self, "subcorpora")

  @property
  def teacher(self) -> Workdir:
    return Workdir(self, TEACHER)

  def run_lock(self, mode: str) -> pathlib.Path:
    """The lock one run of `mode` at a time holds (`train.lock`, `qsft.lock`, `teacher.lock`)."""
    return pathlib.Path(self, f"{mode}.lock")


def tensorboard_run(metrics: pathlib.Path) -> pathlib.Path:
  """The folder of the TensorBoard event files that mirror a metrics file: `tensorboard/<run>`
  beside it, the run named after the file (`metrics.jsonl`: train, `qsft_metrics.jsonl`: qsft).
  The teacher's workdir has its own (`teacher/tensorboard/train`)."""
  name = metrics.name.removesuffix(".jsonl")
  run = "train" if name == "metrics" else name.removesuffix("_metrics")
  return pathlib.Path(metrics.parent, TENSORBOARD, run)
