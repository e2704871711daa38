"""The train batch source: deterministic shuffled batches of answerable features by global step."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dpjax.data.squad import RCFeatures


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
      raise ValueError(f"only {len(self.usable)} answerable training features for a batch of "
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
