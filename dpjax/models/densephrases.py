"""The DensePhrases dual encoder (Lee et al. 2021): phrase encoder, question encoders, filter.

- The phrase encoder gives one vector h_t per passage token; a phrase (i, j) is [h_i, h_j], with
  the same last-layer vector serving as start and end (as in the reference implementation).
- Two question encoders give q_start and q_end from their [CLS] vectors; the phrase score is
  s(q, (i, j)) = q_start . h_i + q_end . h_j.
- The token filter is a linear head on h_t giving a start and an end logit per token.
All encoders start from the same pretrained checkpoint; the filter head starts at zero.
"""
from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from dpjax.errors import ConfigError
from dpjax.models.bert import BertConfig, BertModel
from dpjax.models import pretrained


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
    q_start = self.query_start_encoder(input_ids, attention_mask, rngs=rngs)[:, 0]
    if self.share_query_encoders:
      return q_start.astype(jnp.float32), q_start.astype(jnp.float32)
    q_end = self.query_end_encoder(input_ids, attention_mask, rngs=rngs)[:, 0]
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


def create_model(model_config) -> DensePhrases:
  """The DensePhrases model a config's `model` section describes.

  `model.init = 'pretrained'` loads `model.name` into all encoders; `'random'` builds the encoder
  of `model.random` (a dict of `BertConfig` fields) with random weights, for tests and debugging.
  """
  dtype = jnp.dtype(model_config.dtype)
  if model_config.init == "pretrained":
    return load_dense_phrases(model_config.name, dtype=dtype, seed=model_config.seed,
                              share_query_encoders=model_config.share_query_encoders)
  if model_config.init == "random":
    return DensePhrases(BertConfig(**model_config.random.to_dict()), dtype=dtype,
                        share_query_encoders=model_config.share_query_encoders,
                        rngs=nnx.Rngs(model_config.seed))
  raise ConfigError(f"unknown model.init {model_config.init!r} (pretrained or random)")
