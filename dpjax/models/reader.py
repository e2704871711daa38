"""The cross-encoder reader, the distillation teacher of DensePhrases (Lee et al. 2021, Sec. 4.2).

One BERT reads `[CLS] question [SEP] passage window [SEP]` (token types 0 / 1) and a linear head
gives a start and an end logit per token; the teacher's logits over a window's tokens are what
the phrase model's start/end distributions are distilled towards (`losses.distillation_loss`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dpjax.errors import ConfigError
from dpjax.models import pretrained
from dpjax.models.bert import BertConfig, BertModel
from dpjax.settings import DataSettings, ModelSettings


class CrossEncoderReader(nnx.Module):
  """BERT over question + window, start/end logits per token."""

  def __init__(self, config: BertConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.encoder = BertModel(config, dtype=dtype, rngs=rngs)
    self.qa_head = nnx.Linear(config.hidden_size, 2, rngs=rngs)

  def __call__(self, input_ids, attention_mask, token_type_ids, *, rngs: nnx.Rngs | None = None):
    """Start and end logits, [B, T, 2] float32."""
    hidden = self.encoder(input_ids, attention_mask, token_type_ids, rngs=rngs)
    return self.qa_head(hidden.astype(jnp.float32))

  def window_logits(self, input_ids, attention_mask, token_type_ids, align, *,
                    rngs: nnx.Rngs | None = None):
    """The logits at the phrase model's window positions, [B, L, 2] (inputs and `align` of
    `dpjax.data.batches.cross_encoder_inputs`)."""
    logits = self(input_ids, attention_mask, token_type_ids, rngs=rngs)
    return jnp.take_along_axis(logits, align[..., None], axis=1)


@functools.lru_cache(maxsize=4)
def _jitted_logits(graphdef: nnx.GraphDef):
  """Cached per graph definition (as `encoders.make_encoders`): every logits shard and every
  evaluation of a training run reuse one compiled function (per input width)."""

  @jax.jit
  def logits(state, *inputs):
    return nnx.merge(graphdef, state)(*inputs)

  return logits


def logits_fn(reader: CrossEncoderReader):
  """The jitted `fn(input_ids, attention_mask, token_type_ids) -> [B, T, 2]` of a reader, at
  its own input positions (for `parallel.map_batches`, whose `lengths` cut T to the batch)."""
  graphdef, state = nnx.split(reader)
  logits = _jitted_logits(graphdef)
  return lambda *inputs: logits(state, *inputs)


def check_input_length(reader: CrossEncoderReader, data: DataSettings) -> None:
  """Refuses windows and questions (`data.max_seq_length`, `max_query_length`) whose
  `[CLS] question [SEP] window [SEP]` rows can be longer than the reader has positions."""
  longest = data.max_seq_length + data.max_query_length - 1
  if longest > reader.config.max_position_embeddings:
    raise ConfigError(f"the reader reads question + window, up to {longest} tokens "
                      f"(data.max_seq_length + data.max_query_length - 1); the encoder has "
                      f"{reader.config.max_position_embeddings} positions")


def create_reader(model: ModelSettings) -> CrossEncoderReader:
  """The reader a config's `model` section describes: `model.name`'s pretrained BERT (the head
  at random) or, with `model.init = 'random'`, the encoder of `model.random`."""
  dtype = jnp.dtype(model.dtype)
  rngs = nnx.Rngs(model.seed)
  if model.init == "pretrained":
    model_dir = pretrained.resolve_model_dir(model.name)
    reader = CrossEncoderReader(pretrained.load_config(model_dir), dtype=dtype, rngs=rngs)
    pretrained.load_bert_weights(reader.encoder, pretrained.load_tensors(model_dir),
                                 source=str(model_dir))
    return reader
  if model.init == "random":
    return CrossEncoderReader(BertConfig(**dataclasses.asdict(model.random)), dtype=dtype,
                              rngs=rngs)
  raise ConfigError(f"unknown model.init {model.init!r} (pretrained or random)")
