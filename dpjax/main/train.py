"""`run.py train`: the phrase and question encoders trained (or resumed from the workdir's last
checkpoint), with RC EM/F1 on dev (`dpjax.training`)."""
from __future__ import annotations

from dpjax.training import train_and_evaluate


def run(config, workdir) -> dict:
  return train_and_evaluate(config, workdir)
