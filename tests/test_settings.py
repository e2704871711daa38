"""Typed config sections (`dpjax.settings`): built from every experiment config, refusing
unknown, missing and mistyped fields by name, recorded as the ConfigDict records itself."""
import dataclasses

import pytest

from dpjax.config import load_config
from dpjax.errors import ConfigError
from dpjax.settings import IndexSettings, Settings, TrainSettings

SPECS = ["experiments/demo.py", "experiments/demo.py:tiny", "experiments/squad.py",
         "experiments/squad.py:cpu", "experiments/squad.py:cpu-base", "experiments/squad.py:paper",
         "experiments/squad.py:tiny"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_config_builds_and_records_as_its_config_dict(spec):
  config = load_config(spec)
  settings = Settings.of(config)
  assert settings.to_dict() == config.to_dict()
  assert settings.index.specs == tuple(config.index.specs)
  assert settings.train.loss.lambda_inb == config.train.loss.lambda_inb


def test_sections_are_frozen_and_typed():
  settings = Settings.of(load_config("experiments/demo.py:tiny"))
  assert isinstance(settings.train, TrainSettings) and isinstance(settings.index, IndexSettings)
  with pytest.raises(dataclasses.FrozenInstanceError):
    settings.index.sparse = True
  assert isinstance(settings.train.freeze, tuple)
  assert settings.data.dir is None and settings.data.train_entities == 6  # synthetic's fields


def test_an_int_is_taken_for_a_float_field():
  config = load_config("experiments/demo.py:tiny")
  config.index.sparse_weight = 2
  weight = Settings.of(config).index.sparse_weight
  assert weight == 2.0 and isinstance(weight, float)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["train"].update(lr=1), "train.lr: no such config field"),
    (lambda c: c["train"]["loss"].update(lambda_x=1.0), "train.loss.lambda_x: no such config"),
    (lambda c: c["data"].pop("max_seq_length"), "data.max_seq_length: missing"),
    (lambda c: c["index"].update(specs="Flat"), "index.specs = 'Flat': must be a list"),
    (lambda c: c["model"]["random"].update(hidden_size="big"),
     "model.random.hidden_size = 'big': must be of type int"),
    (lambda c: c["eval"].update(regex=1), "eval.regex = 1: must be of type bool"),
    (lambda c: c["train"].update(batch_size=True), "train.batch_size = True: must be of type int"),
    (lambda c: c.update(extra={}), "extra: no such config field"),
])
def test_bad_fields_are_refused_by_name(change, message):
  config = load_config("experiments/demo.py:tiny").to_dict()
  change(config)
  with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
    Settings.of(config)
