"""`run.py teacher`: the cross-encoder teacher trained (or resumed), then its logits written.
"""
from __future__ import annotations

import contextlib
import logging

from dpjax import distributed
from dpjax.errors import ConfigError
from dpjax.io import workdir_lock
from dpjax.workdir import Workdir
from dpjax.teacher import TEACHER, write_logits
from dpjax.settings import Settings
from dpjax.training import RunSettings, train_and_evaluate
from dpjax.main import writes_to

log = logging.getLogger(__name__)


@writes_to
def run(settings: Settings, workdir: Workdir) -> dict:
  """`run.py teacher`: trains (or resumes) the teacher, then writes (or resumes) its logits."""
  if settings.train.teacher_logits:
    raise ConfigError("train.teacher_logits is set: the teacher is trained without one "
                      "(leave it empty for `run.py teacher`)")
  workdir.teacher.mkdir(parents=True, exist_ok=True)
  # Training takes teacher/train.lock itself; this one also covers the logits (two runs would
  # write the same shards' temporary folders).
  with (workdir_lock(workdir.teacher.run_lock("teacher"), "teacher") if distributed.is_main()
        else contextlib.nullcontext()):
    # The teacher is validated on RC only (subcorpus validation encodes phrases).
    run_settings = RunSettings(model=settings.model, data=settings.data, train=settings.train,
                               evaluation=settings.eval)
    record = train_and_evaluate(run_settings, workdir, TEACHER)
    manifest = write_logits(run_settings, workdir)
  log.info("teacher: dev RC EM %.2f F1 %.2f; logits of %d examples in %s",
           record.get("rc_exact_match", float("nan")), record.get("rc_f1", float("nan")),
           manifest["rows"], workdir.teacher / "logits")
  return {**record, "logits_rows": manifest["rows"]}
