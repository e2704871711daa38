"""Data: tokenizer wrapper, SQuAD-format reading, features, and the synthetic default set."""
from __future__ import annotations

import dataclasses
import logging
import pathlib

from dpjax.data.squad import (Passage, Question, RCFeatures, SkipSummary, build_features,
                              read_squad)
from dpjax.errors import DataError
from dpjax.data.synthetic import write_synthetic
from dpjax.errors import ConfigError
from dpjax.data.tokenization import Tokenizer
from dpjax.data.windows import PassageWindows, build_windows

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RCSplit:
  """One split of a reading-comprehension data set, read and featurised."""

  path: pathlib.Path
  passages: list[Passage]
  questions: list[Question]
  features: RCFeatures
  summary: SkipSummary


def data_files(data_config, workdir: str | pathlib.Path) -> dict[str, pathlib.Path]:
  """The train/dev files a config names; the synthetic set is (re)generated into the workdir."""
  if data_config.source == "synthetic":
    return write_synthetic(pathlib.Path(workdir) / "data", seed=data_config.seed,
                           num_train_entities=data_config.train_entities,
                           num_dev_entities=data_config.dev_entities,
                           questions_per_entity=data_config.questions_per_entity)
  if data_config.source == "squad":
    root = pathlib.Path(data_config.dir)
    return {"train": root / data_config.train_file, "dev": root / data_config.dev_file}
  raise ConfigError(f"unknown data.source {data_config.source!r} (synthetic or squad)")


def load_rc_split(path: str | pathlib.Path, tokenizer: Tokenizer, data_config,
                  limit: int | None = None) -> RCSplit:
  """Reads a SQuAD-format file, logs the skip summary, and builds features."""
  passages, questions, summary = read_squad(path)
  log.info("%s: %d questions, %d passages, %d records skipped", path, len(questions),
           len(passages), summary.total)
  if limit:
    questions = questions[:limit]
  if summary.total:
    log.warning("%s", summary)
  if not questions:
    raise DataError(f"{path}: no usable questions")
  features = build_features(tokenizer, passages, questions,
                            max_seq_length=data_config.max_seq_length,
                            doc_stride=data_config.doc_stride,
                            max_query_length=data_config.max_query_length,
                            include_title=data_config.include_title)
  return RCSplit(pathlib.Path(path), passages, questions, features, summary)
