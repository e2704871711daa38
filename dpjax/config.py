"""Experiment configs: `experiments/<name>.py[:arg]` files with `get_config(arg)`."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
from typing import Sequence

import ml_collections


def load_config(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path/to/config.py[:arg]` and applies `key.sub=value` overrides.

  Override values are parsed as Python literals when possible (`3`, `1e-4`, `True`, `'x'`),
  otherwise taken as strings.
  """
  path, _, arg = spec.partition(":")
  file = pathlib.Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"config file not found: {file}")
  module_spec = importlib.util.spec_from_file_location(f"dpjax_config_{file.stem}", file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise AttributeError(f"{file} defines no get_config(arg)")
  config = module.get_config(arg or None)
  for override in overrides:
    key, sep, raw = override.partition("=")
    if not sep:
      raise ValueError(f"override {override!r} is not of the form key=value")
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = raw
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    if leaf not in node:
      raise KeyError(f"override {key!r}: no such config field")
    node[leaf] = type(node[leaf])(value) if isinstance(node[leaf], float) else value
  return config


# Pieces shared by the experiment configs in experiments/.
def model_config(name: str = "minilm-l6") -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({
      "init": "pretrained",  # or "random" (uses `random`), for tests
      "name": name,  # local dir, alias (minilm-l6) or Hugging Face Hub id
      "tokenizer": name,
      "share_query_encoders": False,
      "dtype": "float32",  # compute dtype: float32 or bfloat16
      "seed": 0,
      # A tiny random encoder (odd sizes so shape bugs show), used by `:tiny` configs.
      "random": {"vocab_size": 30522, "hidden_size": 30, "num_hidden_layers": 2,
                 "num_attention_heads": 3, "intermediate_size": 37,
                 "max_position_embeddings": 512},
  })


def make_tiny(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks a config to a seconds-long CPU run of the same code path."""
  config.model.init = "random"
  config.eval.batch_size = 8
  return config
