"""`run.py qsft`: query-side fine-tuning of the workdir's question encoders on its index.
"""
from __future__ import annotations

import jax

from dpjax.workdir import Workdir
from dpjax.qsft import QsftRunSettings, fine_tune, workdir_lock
from dpjax.main import writes_to
from dpjax.settings import Settings


@writes_to
def run(settings: Settings, workdir: Workdir) -> dict:
  """`run.py qsft`: fine-tunes the question encoders of the workdir's model on its index (one run
  per workdir at a time: `<workdir>/qsft.lock`)."""
  sections = QsftRunSettings(
      model=settings.model, data=settings.data, train=settings.train, evaluation=settings.eval,
      validation=settings.validation, index=settings.index, qsft=settings.qsft)
  if jax.process_index() != 0:
    return fine_tune(sections, workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  with workdir_lock(workdir.run_lock("qsft")):
    return fine_tune(sections, workdir)
