"""The DensePhrases dual encoder (Lee et al. 2021): phrase encoder, question encoders, filter.

- The phrase encoder gives one vector h_t per passage token; a phrase (i, j) is [h_i, h_j], with
  the same last-layer vector serving as start and end (as in the reference implementation).
- Two question encoders give q_start and q_end from their [CLS] vectors; the phrase score is
  s(q, (i, j)) = q_start . h_i + q_end . h_j.
- The token filter is a linear head on h_t giving a start and an end logit per token.
All encoders start from the same pretrained checkpoint; the filter head starts at zero.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from dpjax.errors import CheckpointError, ConfigError
from dpjax.io import atomic_directory, write_json
from dpjax.models.bert import BertConfig, BertModel
from dpjax.models import pretrained
from dpjax.settings import DataSettings, ModelSettings


class DensePhrases(nnx.Module):
  """Phrase encoder, start/end question encoders and token-filter head."""

  def __init__(self, config: BertConfig, *, share_query_encoders: bool = False,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.share_query_encoders = share_query_encoders
    self.phrase_encoder = BertModel(config, dtype=dtype, rngs=rngs)
    self.query_start_encoder = BertModel(config, dtype=dtype, rngs=rngs)
    # A shared encoder is the same module object: NNX keeps one set of parameters for it.
    self.query_end_encoder = (self.query_start_encoder if share_query_encoders
                              else BertModel(config, dtype=dtype, rngs=rngs))
    self.filter_head = nnx.Linear(config.hidden_size, 2, kernel_init=nnx.initializers.zeros,
                                  rngs=rngs)

  def encode_phrases(
      self,
      input_ids,  # [B, L] int
      attention_mask,  # [B, L] {0, 1}
      token_type_ids=None,  # [B, L] int
      *,
      rngs: nnx.Rngs | None = None,
  ):
    """Token vectors h_t, [B, L, D] float32."""
    hidden = self.phrase_encoder(input_ids, attention_mask, token_type_ids, rngs=rngs)
    return hidden.astype(jnp.float32)

  def encode_questions(
      self,
      input_ids,  # [B, Lq] int
      attention_mask,  # [B, Lq] {0, 1}
      *,
      rngs: nnx.Rngs | None = None,
  ):
    """Question vectors (q_start, q_end), each [B, D] float32, from the [CLS] position."""
    q_start = self.query_start_encoder(input_ids, attention_mask, rngs=rngs, first_only=True)[:, 0]
    if self.share_query_encoders:
      return q_start.astype(jnp.float32), q_start.astype(jnp.float32)
    q_end = self.query_end_encoder(input_ids, attention_mask, rngs=rngs, first_only=True)[:, 0]
    return q_start.astype(jnp.float32), q_end.astype(jnp.float32)

  def encode_packed_questions(
      self,
      input_ids,  # [B, L] int: several questions a row, each `[CLS] ... [SEP]`
      segment_ids,  # [B, L] int: each token's question in its row (1, 2, ...), 0 for padding
      position_ids,  # [B, L] int: positions from 0 in each question
      max_segments: int,  # S: the most questions a row holds
  ):
    """Question vectors (q_start, q_end), each [B, S, D] float32, of packed rows (row b's
    question s + 1 at [b, s]; where a row holds fewer, its first question's again): those of
    the questions encoded one a row (`encode_questions`) up to float rounding, without the
    compute on padding that short questions take in rows as wide as the longest one."""
    starts = (position_ids == 0) & (segment_ids > 0)  # each question's [CLS]
    numbers = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)[None, :, None]
    first_positions = jnp.argmax(starts[:, None, :] & (segment_ids[:, None, :] == numbers), -1)
    kwargs = dict(segment_ids=segment_ids, position_ids=position_ids,
                  query_positions=first_positions)  # segment 0: padding, masked
    q_start = self.query_start_encoder(input_ids, **kwargs)
    q_end = q_start if self.share_query_encoders else self.query_end_encoder(input_ids, **kwargs)
    return q_start.astype(jnp.float32), q_end.astype(jnp.float32)

  def filter_logits(self, token_vectors):
    """Start and end filter logits, [B, L, 2], from token vectors [B, L, D]."""
    return self.filter_head(token_vectors)


def load_dense_phrases(name: str | os.PathLike = pretrained.DEFAULT_MODEL, *,
                       share_query_encoders: bool = False, dtype=jnp.float32,
                       seed: int = 0) -> DensePhrases:
  """Builds a DensePhrases model whose encoders all start from one pretrained checkpoint."""
  model_dir = pretrained.resolve_model_dir(name)
  config = pretrained.load_config(model_dir)
  model = DensePhrases(config, share_query_encoders=share_query_encoders, dtype=dtype,
                       rngs=nnx.Rngs(seed))
  tensors = pretrained.load_tensors(model_dir)
  encoders = [model.phrase_encoder, model.query_start_encoder]
  if not share_query_encoders:
    encoders.append(model.query_end_encoder)
  for encoder in encoders:
    pretrained.load_bert_weights(encoder, tensors, source=str(model_dir))
  return model


def create_model(model: ModelSettings) -> DensePhrases:
  """The DensePhrases model a config's `model` section describes.

  `model.init = 'pretrained'` loads `model.name` into all encoders; `'random'` builds the encoder
  of `model.random` (a dict of `BertConfig` fields) with random weights, for tests and debugging.
  """
  dtype = jnp.dtype(model.dtype)
  if model.init == "pretrained":
    return load_dense_phrases(model.name, dtype=dtype, seed=model.seed,
                              share_query_encoders=model.share_query_encoders)
  if model.init == "random":
    return DensePhrases(BertConfig(**dataclasses.asdict(model.random)), dtype=dtype,
                        share_query_encoders=model.share_query_encoders,
                        rngs=nnx.Rngs(model.seed))
  raise ConfigError(f"unknown model.init {model.init!r} (pretrained or random)")


def model_for_data(model: ModelSettings, data: DataSettings) -> DensePhrases:
  """`create_model(model)`, refusing (a ConfigError) a `data.max_seq_length` or
  `data.max_query_length` past the encoder's positions: those positions would embed as NaN
  (`jnp.take` fills out of range) and every vector of the window with them."""
  built = create_model(model)
  positions = built.config.max_position_embeddings
  for key in ("max_seq_length", "max_query_length"):
    if getattr(data, key) > positions:
      source = model.name if model.init == "pretrained" else "random"
      raise ConfigError(f"data.{key} = {getattr(data, key)}: the encoder ({source}) has only "
                        f"{positions} positions")
  return built


def compute_dtype(model: DensePhrases) -> str:
  """The name of the dtype the model's matrix products are computed in ("float32", ...)."""
  return jnp.dtype(model.phrase_encoder.embeddings.dtype).name


def with_compute_dtype(model: DensePhrases, dtype) -> DensePhrases:
  """The same model, sharing its parameters (float32 either way), computing in `dtype`: e.g. a
  bfloat16 dump of a float32-trained model. The model itself when it computes in `dtype`."""
  if compute_dtype(model) == jnp.dtype(dtype).name:
    return model
  return nnx.merge(_graphdef(model.config, model.share_query_encoders, jnp.dtype(dtype).name),
                   nnx.state(model))


@functools.lru_cache(maxsize=8)
def _graphdef(config: BertConfig, share_query_encoders: bool, dtype: str):
  """The graph of a DensePhrases computing in `dtype`, made once a process: building it (the
  modules' initialisers traced abstractly) takes seconds, which every bfloat16 dump of a
  float32 model paid again (results/code_measurements.md)."""
  return nnx.graphdef(nnx.eval_shape(lambda: DensePhrases(
      config, dtype=jnp.dtype(dtype), share_query_encoders=share_query_encoders,
      rngs=nnx.Rngs(0))))


# An exported model: one Hugging Face BERT folder per encoder, the filter head, how they pair.
EXPORT_ENCODERS = {"phrase": "phrase_encoder", "query_start": "query_start_encoder",
                   "query_end": "query_end_encoder"}
EXPORT_INFO = "densephrases.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt")


def bert_tensors(encoder) -> dict[str, np.ndarray]:
  """The encoder's parameters as Hugging Face `BertModel` tensors (float32, by name)."""
  params = {path: np.asarray(var[...]) for path, var in nnx.iter_graph(encoder)
            if isinstance(var, nnx.Param)}
  return {name: np.ascontiguousarray(transform(params[path]), dtype=np.float32)  # self-inverse
          for name, (path, transform) in pretrained.bert_name_map(encoder.config).items()}


def export_dense_phrases(model: DensePhrases, out: str | os.PathLike, *,
                         tokenizer_dir: str | os.PathLike | None = None,
                         info: dict | None = None) -> pathlib.Path:
  """Writes `out/{phrase,query_start,query_end}/` (config.json, model.safetensors and the
  tokenizer files: each loads as a Hugging Face `BertModel`), `out/filter_head.safetensors` and
  `out/densephrases.json` (which folder is which; the score). Written whole or not at all."""
  out = pathlib.Path(out)
  config = {"model_type": "bert", "architectures": ["BertModel"],
            **dataclasses.asdict(model.config)}
  with atomic_directory(out) as tmp:
    for name, attr in EXPORT_ENCODERS.items():
      if name == "query_end" and model.share_query_encoders:
        continue  # one question encoder for start and end
      folder = tmp / name
      folder.mkdir()
      save_file(bert_tensors(getattr(model, attr)), str(folder / "model.safetensors"))
      write_json(folder / "config.json", config)
      for file in TOKENIZER_FILES:
        if tokenizer_dir and (pathlib.Path(tokenizer_dir) / file).is_file():
          shutil.copy(pathlib.Path(tokenizer_dir) / file, folder / file)
    head = nnx.state(model.filter_head, nnx.Param)
    save_file({"kernel": np.asarray(head["kernel"][...], np.float32),
               "bias": np.asarray(head["bias"][...], np.float32)},
              str(tmp / "filter_head.safetensors"))
    write_json(tmp / EXPORT_INFO, {
        "format": "dpjax-densephrases-1", "share_query_encoders": model.share_query_encoders,
        "encoders": {name: name if not (name == "query_end" and model.share_query_encoders)
                     else "query_start" for name in EXPORT_ENCODERS},
        "score": "q_start . h_i + q_end . h_j; q from the [CLS] vector of the question encoders, "
                 "h_i the last hidden state of the phrase encoder at token i",
        "filter_head": "filter_head.safetensors: logits = h @ kernel + bias, [start, end]",
        **(info or {})})
  return out


def load_exported(path: str | os.PathLike, *, dtype=jnp.float32) -> DensePhrases:
  """The DensePhrases model of an `export_dense_phrases` folder."""
  path = pathlib.Path(path)
  try:
    info = json.loads((path / EXPORT_INFO).read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path / EXPORT_INFO}: not an exported dpjax model ({e})") from None
  model = DensePhrases(pretrained.load_config(path / "phrase"), dtype=dtype,
                       share_query_encoders=info["share_query_encoders"], rngs=nnx.Rngs(0))
  for name, attr in EXPORT_ENCODERS.items():
    if name == "query_end" and model.share_query_encoders:
      continue
    folder = path / info["encoders"][name]
    pretrained.load_bert_weights(getattr(model, attr), pretrained.load_tensors(folder),
                                 source=str(folder))
  head = load_file(str(path / "filter_head.safetensors"))
  state = nnx.state(model.filter_head, nnx.Param)
  state["kernel"].set_value(head["kernel"])
  state["bias"].set_value(head["bias"])
  nnx.update(model.filter_head, state)
  return model
