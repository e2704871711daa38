"""The train batch source: deterministic shuffled batches of answerable features by global step."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dpjax.data.squad import RCFeatures
from dpjax.errors import DataError


@dataclasses.dataclass
class TrainBatches:
  """Deterministic shuffled batches of answerable features; position = global step."""

  features: RCFeatures
  batch_size: int
  seed: int
  hard_negatives: Any = None  # a `mining.HardNegatives`: adds h mined passages per example

  def __post_init__(self):
    self.usable = np.flatnonzero(self.features.start_position > 0)  # answer inside the window
    if len(self.usable) < self.batch_size:
      raise DataError(f"only {len(self.usable)} answerable training features for a batch of "
                       f"{self.batch_size}")
    self.steps_per_epoch = len(self.usable) // self.batch_size

  def position(self, step: int) -> tuple[int, int]:
    return divmod(step, self.steps_per_epoch)

  def __call__(self, step: int, part: slice = slice(None)) -> dict[str, np.ndarray]:
    """The batch of `step`, or only its rows `part` (a process's share of the global batch)."""
    epoch, index = self.position(step)
    order = np.random.default_rng([self.seed, epoch]).permutation(self.usable)
    rows = order[index * self.batch_size:(index + 1) * self.batch_size][part]
    f, w = self.features, self.features.windows
    window = f.window_index[rows]
    question = f.question_index[rows]
    # Passage-level ids: no token of an example's passage (any window) is ever its negative.
    batch = {"input_ids": w.input_ids[window], "attention_mask": w.attention_mask[window],
             "context_mask": w.context_mask[window],
             "passage_ids": w.passage_index[window].astype(np.int32),
             "start_positions": f.start_position[rows], "end_positions": f.end_position[rows],
             "question_input_ids": f.question_input_ids[question],
             "question_attention_mask": f.question_attention_mask[question]}
    if self.hard_negatives is not None:
      batch.update(self.hard_negatives(step, question))
    return batch


@dataclasses.dataclass
class GroupedBatches:
  """Passage-grouped batches: `windows_per_batch` windows, each with up to `group` of its own
  answerable features (questions), so that a window is encoded once for all its questions.

  Every answerable feature is in exactly one group of every epoch (the features of a window,
  shuffled, cut into groups of at most `group`; the groups shuffled); an epoch's last batch is
  filled up with empty windows (no context tokens, no questions). A batch holds windows [W, L]
  and question slots [W * group, ...] window by window; `question_valid` marks the filled slots
  (an empty slot repeats a question of its window, so it computes but does not count).
  """

  features: RCFeatures
  windows_per_batch: int
  group: int
  seed: int
  # (epoch, its groups): the groups of the current epoch, built once.
  _cached: tuple = dataclasses.field(default=(None, None), init=False, repr=False)

  def __post_init__(self):
    usable = np.flatnonzero(self.features.start_position > 0)  # answer inside the window
    windows = self.features.window_index[usable]
    order = np.argsort(windows, kind="stable")
    self.by_window = np.split(usable[order], np.flatnonzero(np.diff(windows[order])) + 1)
    self.num_groups = sum(-(-len(f) // self.group) for f in self.by_window)
    if self.num_groups < self.windows_per_batch:
      raise DataError(f"only {self.num_groups} groups of answerable training features for a "
                       f"batch of {self.windows_per_batch} windows")
    self.steps_per_epoch = -(-self.num_groups // self.windows_per_batch)

  def position(self, step: int) -> tuple[int, int]:
    return divmod(step, self.steps_per_epoch)

  def groups(self, epoch: int) -> list[np.ndarray]:
    """The epoch's groups of feature rows, in batch order."""
    if self._cached[0] != epoch:
      rng = np.random.default_rng([self.seed, epoch])
      groups = [chunk for features in self.by_window
                for chunk in np.array_split(rng.permutation(features),
                                            -(-len(features) // self.group))]
      self._cached = (epoch, [groups[i] for i in rng.permutation(len(groups))])
    return self._cached[1]

  def __call__(self, step: int, part: slice = slice(None)) -> dict[str, np.ndarray]:
    """The batch of `step`, or only its windows `part` (a process's share of the global batch)
    with their question slots."""
    epoch, index = self.position(step)
    groups = self.groups(epoch)[index * self.windows_per_batch:
                                (index + 1) * self.windows_per_batch]
    groups += [None] * (self.windows_per_batch - len(groups))  # the epoch's last batch
    groups = groups[part]
    f, w = self.features, self.features.windows
    filled = [g if g is not None else self.by_window[0][:1] for g in groups]
    window = f.window_index[[g[0] for g in filled]]
    slots = np.array([[g[min(i, len(g) - 1)] for i in range(self.group)] for g in filled])
    valid = np.array([[g is not None and i < len(g) for i in range(self.group)] for g in groups])
    rows, question = slots.reshape(-1), f.question_index[slots.reshape(-1)]
    real = np.array([g is not None for g in groups])
    return {"input_ids": w.input_ids[window], "attention_mask": w.attention_mask[window],
            "context_mask": w.context_mask[window] & real[:, None],
            "passage_ids": np.where(real, w.passage_index[window], -1).astype(np.int32),
            "start_positions": f.start_position[rows], "end_positions": f.end_position[rows],
            "question_input_ids": f.question_input_ids[question],
            "question_attention_mask": f.question_attention_mask[question],
            "question_valid": valid.reshape(-1)}
