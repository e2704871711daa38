"""`run.py teacher`: the cross-encoder teacher of distillation, trained and its logits written.

1. Trains a `CrossEncoderReader` (`[CLS] question [SEP] window [SEP]`, start/end head, our BERT
   from `model.name`) on the training examples with `train`'s settings, the same jitted step,
   checkpoints, resume and hooks as `run.py train`, into `<workdir>/teacher/` (checkpoints,
   metrics.jsonl, results.json with its dev RC EM/F1, rc_predictions.json).
2. Writes its start/end logits over the examples of every step of the phrase model's run (the
   same `train` settings: batch size, seed, steps, passage grouping) to
   `<workdir>/teacher/logits` (sharded, resumable, fingerprinted by the teacher's parameters and
   the training data; `dpjax.data.teacher_logits`).

The phrase model then distils with `--set train.teacher_logits=teacher/logits`
(`train.loss.lambda_distill` x KL(teacher || student) in the unified recipe, `weight_distill`
in the original one).
"""
from __future__ import annotations

import logging

import numpy as np
from flax import nnx

from dpjax.checkpoint import restore_params
from dpjax.data import Tokenizer, data_files, load_rc_split
from dpjax.data.batches import TeacherBatches
from dpjax.data.teacher_logits import write_teacher_logits
from dpjax.errors import DataError
from dpjax import distributed
from dpjax.io import digest
from dpjax.workdir import TEACHER as TEACHER_DIR, Workdir
from dpjax.models.reader import check_input_length, create_reader
from dpjax.objectives import TEACHER_OBJECTIVE
from dpjax.parallel import make_mesh, round_to_devices
from dpjax.reading import reader_logits
from dpjax.settings import DataSettings, ModelSettings
from dpjax.training import PHRASE, RunSettings, Spec, features_fingerprint

log = logging.getLogger(__name__)


def _reader(model: ModelSettings, data: DataSettings):
  """The teacher to train: `model`'s reader, refused when `data`'s rows are too long for it."""
  reader = create_reader(model)
  check_input_length(reader, data)
  return reader


TEACHER = Spec("teacher", TEACHER_DIR, _reader, lambda data, train, reader: TEACHER_OBJECTIVE,
               lambda data, train, split, workdir, fingerprint: TeacherBatches(
                   split.features, train.batch_size, train.seed))


def write_logits(settings: RunSettings, workdir: Workdir) -> dict:
  """The teacher's logits over the examples of every step of the phrase model's run (its
  `data` and `train` sections: the same batches), from the teacher's latest checkpoint."""
  data, train = settings.data, settings.train
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  split = load_rc_split(data_files(data, workdir)["train"], tokenizer, data)
  fingerprint = features_fingerprint(split.features)
  batches = PHRASE.batches(data, train, split, workdir, fingerprint)
  total = train.num_steps or train.epochs * batches.steps_per_epoch
  rows = np.unique(np.concatenate([batches.rows(step) for step in range(total)]))
  reader = _reader(settings.model, data)
  step = restore_params(workdir.teacher.checkpoints(), reader)
  if step is None:
    raise DataError(f"{workdir.teacher.checkpoints()}: no teacher checkpoint")
  mesh = make_mesh()
  batch_size = round_to_devices(settings.evaluation.batch_size, mesh)

  def compute(part: np.ndarray) -> np.ndarray:
    out = np.full((len(part), 2, data.max_seq_length), np.nan, np.float32)
    slot = {row: i for i, row in enumerate(part.tolist())}  # batches come longest first
    for rows, logits in reader_logits(reader, split.features, part, mesh=mesh,
                                      batch_size=batch_size):
      out[[slot[r] for r in rows.tolist()]] = np.moveaxis(logits, 2, 1)
    bad = ~np.isfinite(out).all(axis=(1, 2))
    if bad.any():  # never written: a diverged teacher, or rows the batches did not cover
      raise DataError(f"the teacher's logits of {int(bad.sum())} training examples (feature "
                      f"rows {part[bad][:5].tolist()}...) are missing or not finite")
    return out

  params = [np.asarray(v[...]) for _, v in nnx.iter_graph(reader) if isinstance(v, nnx.Param)]
  identity = {"teacher": digest(*params), "step": step, "data": fingerprint,
              "length": data.max_seq_length}
  return write_teacher_logits(workdir.teacher / "logits", identity, rows, compute,
                              main=distributed.is_main(), barrier=distributed.barrier)
