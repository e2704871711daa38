"""`run.py train`: the phrase and question encoders trained (or resumed from the workdir's last
checkpoint), with RC EM/F1 on dev (`dpjax.training`)."""
from __future__ import annotations

from dpjax.settings import Settings
from dpjax.training import RunSettings, train_and_evaluate


def run(settings: Settings, workdir) -> dict:
  """Trains the phrase model with the config's model, data, train, eval and validation."""
  return train_and_evaluate(
      RunSettings(model=settings.model, data=settings.data, train=settings.train,
                  evaluation=settings.eval, validation=settings.validation), workdir)
