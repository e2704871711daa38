"""`run.py index`: the configured faiss indexes over the dump (with `index.sparse`, its BM25)."""
from __future__ import annotations

import functools
import logging
import pathlib

import numpy as np

from dpjax.data import Tokenizer
from dpjax.errors import ConfigError
from dpjax.index import residual
from dpjax.index.hybrid_weights import build_sparse_index, tune_questions
from dpjax.index.faiss_index import build_index
from dpjax.workdir import Workdir
from dpjax.loading import checked_dump, restore_model
from dpjax.main import writes_to
from dpjax.models.encoders import encode_questions
from dpjax.settings import Settings

log = logging.getLogger(__name__)


@writes_to
def run(settings: Settings, workdir: Workdir) -> list[pathlib.Path]:
  """`run.py index`: the configured faiss indexes (`index.specs`) over the dump, and with
  `index.sparse` its BM25 index and hybrid weight (`dpjax.index.hybrid_weights`)."""
  index = settings.index
  dump = workdir.dump(index.dump_name)
  checked_dump(settings.data, index, workdir)
  # encoded once, and only for an index coded from the dump's vectors (not its codes)
  weighting = functools.cache(lambda: question_weighting(settings, workdir))
  built = [build_index(dump, spec, filter_threshold=index.filter_threshold,
                       train_size=index.train_size, nprobe=index.nprobe, weighting=weighting)
           for spec in index.specs]
  if index.sparse:  # after the faiss indexes: choosing its weight searches one
    built.append(build_sparse_index(settings.model, settings.data, settings.eval, index,
                                    workdir, best_metric=settings.validation.metric))
  return built


def question_weighting(settings: Settings, workdir: Workdir) -> residual.Weighting:
  """The question weighting of a compact index (`residual.Weighting`): the second moment of
  the start and end vectors of the training questions the hybrid weights are chosen on
  (`index.sparse_tune_questions` of them), encoded by the workdir's model (`eval.checkpoint`)."""
  try:
    questions, path = tune_questions(settings.data, settings.index, workdir)
  except ConfigError:  # (its message names the hybrid weights)
    raise ConfigError("index.specs: a question-weighted compact index (qw:) needs training "
                      "questions (data.train or index.sparse_tune_file); use compact:pr: "
                      "without them") from None
  model, step = restore_model(settings.model, settings.data, settings.eval, workdir)
  q_start, q_end = encode_questions(
      model, Tokenizer.from_pretrained(settings.model.tokenizer),
      [q.question for q in questions], max_query_length=settings.data.max_query_length,
      batch_size=settings.eval.batch_size)
  log.info("question weighting from %d questions of %s (model step %s)", len(questions), path,
           step)
  return residual.Weighting.of_questions(np.concatenate([q_start, q_end]))
