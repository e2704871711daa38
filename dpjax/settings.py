"""Typed config sections: frozen dataclasses built once from an experiment's ConfigDict.

A mode's program (`dpjax.main.<mode>`) receives `Settings` (every section, built by
`config.run_in_workdir`) and gives each library function the sections it reads, so no library
function sees the whole config. The defaults stay declared once, in `dpjax.config`'s section
functions; these classes declare the fields and their types, and `Settings.of` refuses a field
of the wrong type or an unknown one with the field's dotted name.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Mapping

from dpjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RandomEncoderSettings:
  """`model.random`: the sizes of a randomly initialised encoder (`model.init = "random"`)."""
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  intermediate_size: int
  max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """`model`: the encoder's weights, tokenizer and compute dtype."""
  init: str
  name: str
  tokenizer: str
  share_query_encoders: bool
  dtype: str
  seed: int
  random: RandomEncoderSettings


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """`data`: the training / dev set and its windows. The source's own fields (synthetic:
  seed and sizes; squad: dir and files) are None for the other source."""
  source: str
  max_seq_length: int
  doc_stride: int
  max_query_length: int
  include_title: bool
  seed: int | None = None
  train_entities: int | None = None
  dev_entities: int | None = None
  questions_per_entity: int | None = None
  dir: str | None = None
  train_file: str | None = None
  dev_file: str | None = None


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """`train.loss`: the unified (Kim et al.) or original (DensePhrases) objective's weights."""
  recipe: str
  lambda_inp: float
  lambda_inb: float
  lambda_prb: float
  lambda_hard: float
  lambda_distill: float
  score_scale: float
  weight_single: float
  weight_distill: float
  weight_negatives: float
  weight_filter: float
  prebatch_size: int
  prebatch_warmup_steps: int
  clear_prebatch_each_epoch: bool
  windows_without_answer: bool


@dataclasses.dataclass(frozen=True)
class HardNegativeSettings:
  """`train.hard_negatives`: the mined negatives file and how many passages per example."""
  file: str
  per_example: int


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """`train`: the optimiser, schedule, batches and checkpoints of a training run."""
  seed: int
  batch_size: int
  questions_per_window: int
  num_steps: int
  epochs: int
  stop_at_step: int
  learning_rate: float
  warmup_steps: int
  warmup_fraction: float
  weight_decay: float
  grad_clip: float
  freeze: tuple[str, ...]
  dropout: bool
  log_every: int
  checkpoint_every: int
  keep_checkpoints: int
  progress_bar: bool
  hard_negatives: HardNegativeSettings
  teacher_logits: str
  loss: LossSettings


@dataclasses.dataclass(frozen=True)
class ValidationSettings:
  """`validation`: subcorpus validation during training and `run.py subcorpus`."""
  corpus: str
  questions: str
  every_steps: int
  metric: str
  limit: int
  sample_questions: int
  kinds: tuple[str, ...]
  seed: int


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """`eval`: RC and open-domain evaluation, the checkpoint read, the reader pipeline."""
  batch_size: int
  max_answer_length: int
  limit: int
  every_steps: int
  checkpoint: str
  passage_k: int
  regex: bool
  allow_untrained: bool
  throughput_questions: int
  reader: str
  reader_passages: int
  reader_mu: float | None
  reader_tune_questions: int


@dataclasses.dataclass(frozen=True)
class ServeSettings:
  """`serve`: the HTTP service's address, key, batching and request limits."""
  host: str
  port: int
  api_key: str
  api_key_env: str
  allow_open: bool
  shutdown_timeout_s: int
  index: str
  max_batch: int
  max_wait_ms: float
  max_queue: int
  max_k: int
  max_questions: int
  max_question_chars: int


@dataclasses.dataclass(frozen=True)
class QsftSettings:
  """`qsft`: query-side fine-tuning on an index."""
  index: str
  quantized: bool
  level: str
  top_k: int
  epochs: int
  batch_size: int
  learning_rate: float
  dropout: bool
  freeze: tuple[str, ...]
  questions: str
  limit: int
  dev_limit: int
  seed: int


@dataclasses.dataclass(frozen=True)
class FilterSettings:
  """`filter`: the token filter head's training and its threshold sweep."""
  train_windows: int
  dev_windows: int
  epochs: int
  batch_size: int
  learning_rate: float
  seed: int
  keep_fractions: tuple[float, ...]
  sweep_questions: int
  max_em_drop: float


@dataclasses.dataclass(frozen=True)
class MineSettings:
  """`mine`: hard negatives of the training questions."""
  top_k: int
  out: str
  limit: int


@dataclasses.dataclass(frozen=True)
class IndexSettings:
  """`index`: the dump, its indexes and search (hybrid included)."""
  corpus: tuple[str, ...]
  dump_name: str
  questions: str
  batch_size: int
  shard_passages: int
  dump_min_context: int
  dump_max_seq_length: int
  dump_workers: int
  dump_dtype: str
  dump_width_multiple: int
  dump_filter_threshold: float | None
  dump_codec: str
  dump_vectors: bool
  specs: tuple[str, ...]
  nprobe: int
  train_size: int
  filter_threshold: float | None
  search_index: str
  search_device: str
  verify: bool
  top_k: int
  unit: str
  sparse: bool
  sparse_weight: float | None
  sparse_sentence_weight: float | None
  sparse_passages: int
  sparse_tune_questions: int
  sparse_tune_file: str
  merge_spans: bool
  reread: int
  reread_margin: float | None
  reread_window: int | None
  reread_checkpoint: str | None


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every section of an experiment's config, typed: what a mode's program reads and hands on,
  a section at a time. Sections an experiment lacks are None (e.g. `train` for a config that
  only searches)."""
  model: ModelSettings
  data: DataSettings
  train: TrainSettings | None = None
  validation: ValidationSettings | None = None
  mine: MineSettings | None = None
  qsft: QsftSettings | None = None
  filter: FilterSettings | None = None
  eval: EvalSettings | None = None
  serve: ServeSettings | None = None
  index: IndexSettings | None = None

  @classmethod
  def of(cls, config: Mapping) -> "Settings":
    """The typed sections of a (checked, defaults-filled) ConfigDict or dict; a ConfigError
    names a missing, unknown or mistyped field."""
    return _build(cls, config, "")

  def to_dict(self) -> dict:
    """The sections as plain JSON values (lists, not tuples), as the ConfigDict's `to_dict`
    gives them; a data source's fields of the other source are left out."""
    return _plain(self)

  def to_json(self) -> str:
    """`to_dict` as JSON text (what a checkpoint's meta records)."""
    return json.dumps(self.to_dict())


def _plain(value):
  if dataclasses.is_dataclass(value):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
            if not (isinstance(value, DataSettings) and getattr(value, f.name) is None)
            and not (isinstance(value, Settings) and getattr(value, f.name) is None)}
  if isinstance(value, tuple):
    return [_plain(v) for v in value]
  return value


def section_dict(section) -> dict:
  """One section as plain JSON values (what a checkpoint or report records of it)."""
  return _plain(section)


def _build(cls, node, where: str):
  """`cls` from the mapping `node` (a ConfigDict or dict), each field converted to its type."""
  given = node.to_dict() if hasattr(node, "to_dict") else node
  if not isinstance(given, Mapping):
    raise ConfigError(f"{where}: a section of fields, not {given!r}")
  where = f"{where}." if where else ""
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(given) - set(fields))
  if unknown:
    raise ConfigError(f"{where}{unknown[0]}: no such config field (known: "
                      f"{', '.join(sorted(fields))})")
  values = {}
  for name, field in fields.items():
    if name in given:
      values[name] = _convert(hints[name], given[name], f"{where}{name}")
    elif field.default is dataclasses.MISSING:
      raise ConfigError(f"{where}{name}: missing (the config has no such field)")
  return cls(**values)


def _convert(hint, value, where: str) -> Any:
  """`value` as type `hint` (a section class, a scalar type, `X | None`, `tuple[X, ...]`)."""
  args = typing.get_args(hint)
  if isinstance(hint, types.UnionType):  # X | None
    if value is None:
      return None
    return _convert(next(a for a in args if a is not type(None)), value, where)
  if dataclasses.is_dataclass(hint):
    return _build(hint, value, where)
  if typing.get_origin(hint) is tuple:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      raise ConfigError(f"{where} = {value!r}: must be a list")
    return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
    raise ConfigError(f"{where} = {value!r}: must be of type {hint.__name__}")
  return value
