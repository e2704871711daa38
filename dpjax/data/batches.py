"""The train batch sources: deterministic shuffled batches of answerable features by global step
(one question per window, passage-grouped, or the cross-encoder teacher's question + window)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import numpy as np

from dpjax.data.squad import RCFeatures
from dpjax.errors import DataError
from dpjax.parallel import call_widths


@dataclasses.dataclass
class TrainBatches:
  """Deterministic shuffled batches of answerable features (`without_answer`: of all of them);
  position = global step."""

  features: RCFeatures
  batch_size: int
  seed: int
  hard_negatives: Any = None  # a `hard_negatives.HardNegatives`: adds h mined passages per example
  teacher: Any = None  # a `TeacherLogits`: adds the teacher's start/end logits per example
  question_multiple: int = 0  # > 0: questions cut per step (`trim_questions`)
  # Also the features whose window lacks the answer (their gold positions are 0: [CLS]).
  without_answer: bool = False

  def __post_init__(self):
    answerable = self.features.start_position > 0  # answer inside the window
    self.usable = np.flatnonzero(answerable | self.without_answer)
    if len(self.usable) < self.batch_size:
      kind = "" if self.without_answer else "answerable "
      raise DataError(f"only {len(self.usable)} {kind}training features for a batch of "
                      f"{self.batch_size}")
    self.steps_per_epoch = len(self.usable) // self.batch_size

  def position(self, step: int) -> tuple[int, int]:
    return divmod(step, self.steps_per_epoch)

  def rows(self, step: int, part: slice = slice(None)) -> np.ndarray:
    """The feature rows (examples) of `step`'s batch, or of its rows `part`."""
    epoch, index = self.position(step)
    order = np.random.default_rng([self.seed, epoch]).permutation(self.usable)
    return order[index * self.batch_size:(index + 1) * self.batch_size][part]

  def __call__(self, step: int, part: slice = slice(None)) -> dict[str, np.ndarray]:
    """The batch of `step`, or only its rows `part` (a process's share of the global batch)."""
    step_rows = self.rows(step)  # one permutation per step (the question cut needs them all)
    rows = step_rows[part]
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
    if self.teacher is not None:
      batch.update(self.teacher.batch(rows))
    return trim_questions(batch, self.features, step_rows, self.question_multiple)


@dataclasses.dataclass
class GroupedBatches:
  """Passage-grouped batches: `windows_per_batch` windows, each with up to `group` of its own
  answerable features (questions; `without_answer`: all its features), so that a window is
  encoded once for all its questions.

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
  teacher: Any = None  # a `TeacherLogits`: adds the teacher's start/end logits per question slot
  question_multiple: int = 0  # > 0: questions cut per step (`trim_questions`)
  # Also the features whose window lacks the answer (their gold positions are 0: [CLS]).
  without_answer: bool = False
  # (epoch, its groups): the groups of the current epoch, built once.
  _cached: tuple = dataclasses.field(default=(None, None), init=False, repr=False)

  def __post_init__(self):
    answerable = self.features.start_position > 0  # answer inside the window
    usable = np.flatnonzero(answerable | self.without_answer)
    windows = self.features.window_index[usable]
    order = np.argsort(windows, kind="stable")
    self.by_window = np.split(usable[order], np.flatnonzero(np.diff(windows[order])) + 1)
    self.num_groups = sum(-(-len(f) // self.group) for f in self.by_window)
    if self.num_groups < self.windows_per_batch:
      kind = "" if self.without_answer else "answerable "
      raise DataError(f"only {self.num_groups} groups of {kind}training features for a "
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

  def _slots(self, step: int, part: slice) -> tuple[list, np.ndarray]:
    """(the groups of `step`'s windows `part`, None for an empty one; their slots' feature rows
    [W, group])."""
    epoch, index = self.position(step)
    groups = self.groups(epoch)[index * self.windows_per_batch:
                                (index + 1) * self.windows_per_batch]
    groups += [None] * (self.windows_per_batch - len(groups))  # the epoch's last batch
    groups = groups[part]
    filled = [g if g is not None else self.by_window[0][:1] for g in groups]
    return groups, np.array([[g[min(i, len(g) - 1)] for i in range(self.group)] for g in filled])

  def rows(self, step: int, part: slice = slice(None)) -> np.ndarray:
    """The feature rows of `step`'s question slots (of its windows `part`)."""
    return self._slots(step, part)[1].reshape(-1)

  def __call__(self, step: int, part: slice = slice(None)) -> dict[str, np.ndarray]:
    """The batch of `step`, or only its windows `part` (a process's share of the global batch)
    with their question slots."""
    groups, slots = self._slots(step, part)
    f, w = self.features, self.features.windows
    window = f.window_index[slots[:, 0]]
    valid = np.array([[g is not None and i < len(g) for i in range(self.group)] for g in groups])
    rows, question = slots.reshape(-1), f.question_index[slots.reshape(-1)]
    real = np.array([g is not None for g in groups])
    teacher = {} if self.teacher is None else self.teacher.batch(rows)
    batch = {**teacher, "input_ids": w.input_ids[window],
             "attention_mask": w.attention_mask[window],
             "context_mask": w.context_mask[window] & real[:, None],
             "passage_ids": np.where(real, w.passage_index[window], -1).astype(np.int32),
             "start_positions": f.start_position[rows], "end_positions": f.end_position[rows],
             "question_input_ids": f.question_input_ids[question],
             "question_attention_mask": f.question_attention_mask[question],
             "question_valid": valid.reshape(-1)}
    return trim_questions(batch, self.features, self.rows(step), self.question_multiple)


def trim_questions(batch: dict, features: RCFeatures, step_rows: np.ndarray,
                   multiple: int) -> dict:
  """The batch with its question arrays cut to the step's longest question rounded up to
  `multiple` tokens (0: kept at data.max_query_length). The width comes from all the step's
  rows (`step_rows`), so every process of a multi-process step cuts its share alike; a few
  widths compile. The columns cut are padding: the question vectors do not change."""
  if not multiple:
    return batch
  width = question_width(features, step_rows, multiple)
  return {**batch, "question_input_ids": batch["question_input_ids"][:, :width],
          "question_attention_mask": batch["question_attention_mask"][:, :width]}


def question_width(features: RCFeatures, step_rows: np.ndarray, multiple: int) -> int:
  """The width `trim_questions` cuts a step's questions to: its longest question rounded up to
  `multiple` tokens, at most the arrays' width."""
  lengths = features.question_attention_mask[features.question_index[step_rows]].sum(1)
  return min(-(-int(lengths.max()) // multiple) * multiple, features.question_input_ids.shape[1])


def question_widths(batches, steps: Iterable[int]) -> list[int]:
  """The distinct question widths of the batches of `steps` (a batch source with `features`,
  `rows(step)` and `question_multiple` > 0), sorted; it stops early once every width is seen."""
  multiple, features = batches.question_multiple, batches.features
  every = set(call_widths(multiple, features.question_input_ids.shape[1]))
  seen: set[int] = set()
  for step in steps:
    seen.add(question_width(features, batches.rows(step), multiple))
    if seen == every:
      break
  return sorted(seen)


def cross_encoder_inputs(window_ids: np.ndarray, window_mask: np.ndarray,
                         question_ids: np.ndarray, question_mask: np.ndarray) -> dict:
  """`[CLS] question [SEP] window-without-its-[CLS]` rows for the reader, and `cross_align`:
  for each of the phrase model's window positions t, the reader's position of that token (so its
  logits line up with the phrase model's; t = 0, the window's [CLS], maps to the question's
  [SEP], a position the context mask excludes).

  window_ids/mask [B, L], question_ids/mask [B, Lq] (each [CLS] ... [SEP], padded right).
  Returns int32 arrays: cross_input_ids, cross_attention_mask, cross_token_type_ids [B, Lq+L-1],
  cross_align [B, L].
  """
  b, length = window_ids.shape
  total = question_ids.shape[1] + length - 1
  nq = question_mask.sum(1).astype(np.int64)  # [B], with [CLS] and [SEP]
  nw = window_mask.sum(1).astype(np.int64)
  position = np.arange(total)[None, :]
  in_question = position < nq[:, None]
  in_window = (position >= nq[:, None]) & (position < (nq + nw - 1)[:, None])
  source = np.clip(position - nq[:, None] + 1, 0, length - 1)  # window column of a position
  ids = np.where(in_question, np.take_along_axis(
      question_ids, np.minimum(position, question_ids.shape[1] - 1).repeat(b, 0), 1), 0)
  ids = np.where(in_window, np.take_along_axis(window_ids, source, 1), ids)
  align = np.minimum(np.arange(length)[None, :] + nq[:, None] - 1, total - 1)
  return {"cross_input_ids": ids.astype(np.int32),
          "cross_attention_mask": (in_question | in_window).astype(np.int32),
          "cross_token_type_ids": in_window.astype(np.int32),
          "cross_align": align.astype(np.int32)}


@dataclasses.dataclass
class TeacherBatches:
  """The cross-encoder teacher's batches: the examples of `TrainBatches` (same order) as
  `[CLS] question [SEP] window` rows, with the phrase model's context mask and gold positions
  (the teacher's logits are read at the phrase model's window positions)."""

  features: RCFeatures
  batch_size: int
  seed: int

  def __post_init__(self):
    self.source = TrainBatches(self.features, self.batch_size, self.seed)
    self.steps_per_epoch = self.source.steps_per_epoch

  def position(self, step: int) -> tuple[int, int]:
    return self.source.position(step)

  def rows(self, step: int, part: slice = slice(None)) -> np.ndarray:
    return self.source.rows(step, part)

  def __call__(self, step: int, part: slice = slice(None)) -> dict[str, np.ndarray]:
    return cross_batch(self.features, self.rows(step, part))


def cross_batch(features: RCFeatures, rows: np.ndarray) -> dict[str, np.ndarray]:
  """The reader's inputs for feature rows, with their context mask and gold positions."""
  w, window, question = features.windows, features.window_index[rows], features.question_index[rows]
  return {**cross_encoder_inputs(w.input_ids[window], w.attention_mask[window],
                                 features.question_input_ids[question],
                                 features.question_attention_mask[question]),
          "context_mask": w.context_mask[window], "start_positions": features.start_position[rows],
          "end_positions": features.end_position[rows]}
