"""BERT encoder as a Flax NNX module.

Exactly the architecture of Hugging Face's `BertModel` without the pooler: word + position +
token-type embeddings, LayerNorm, dropout; N post-LayerNorm transformer layers (self-attention with
an additive padding mask, exact-erf GELU feed-forward). Parameters are kept in float32; `dtype`
chooses the compute dtype of the matrix products (float32 or bfloat16). LayerNorm and the
attention softmax always run in float32.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from dpjax.models import flash_attention
from dpjax.models.dropout import Dropout

_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Hyper-parameters of a BERT encoder (the fields of a Hugging Face `config.json`)."""

  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  initializer_range: float = 0.02
  pad_token_id: int = 0

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                       f"num_attention_heads {self.num_attention_heads}")
    if self.hidden_act not in _ACTIVATIONS:
      raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; "
                       f"supported: {sorted(_ACTIVATIONS)}")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "BertConfig":
    """Builds a config from a Hugging Face `config.json` dict; unknown keys are ignored."""
    model_type = values.get("model_type", "bert")
    if model_type != "bert":
      raise ValueError(f"model_type {model_type!r} is not supported (only 'bert')")
    position_type = values.get("position_embedding_type", "absolute")
    if position_type != "absolute":
      raise ValueError(f"position_embedding_type {position_type!r} is not supported")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in values.items() if k in names and v is not None}
    return cls(**kwargs)


def _float32_sums(dtype) -> bool:
  """Whether products of `dtype` are summed into float32 and rounded after (`_dot_general`):
  bfloat16 on XLA:CPU, whose bfloat16-out matrix products run slower than bfloat16 in, float32
  out, and slower than float32 (results/code_measurements.md).
  GPUs sum in float32 inside their bfloat16 kernels already; their programs are left as they
  were measured."""
  return jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"


def _dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None, **kwargs):
  """`lax.dot_general`, bfloat16 on CPU summed in float32 (`_float32_sums`), then rounded; a
  dense layer's product (`_bf16_matmul`) also in its backward pass."""
  if not _float32_sums(lhs.dtype):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers,
                               preferred_element_type=preferred_element_type, **kwargs)
  if (dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and rhs.ndim == 2
      and rhs.dtype == lhs.dtype and not any(kwargs.values())):
    return _bf16_matmul(lhs, rhs)
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32,
                             **kwargs).astype(lhs.dtype)


def _matmul_sums(x, w, contract_x: int, contract_w: int):
  return jax.lax.dot_general(x, w, (((contract_x,), (contract_w,)), ((), ())),
                             preferred_element_type=jnp.float32)


@jax.custom_vjp
def _bf16_matmul(x, w):
  """x [..., in] @ w [in, out] in bfloat16, summed in float32; its gradients likewise (JAX's own
  transposes would multiply the float32 cotangent by bfloat16 operands: XLA:CPU's slow
  mixed-type products)."""
  return _matmul_sums(x, w, x.ndim - 1, 0).astype(x.dtype)


def _bf16_matmul_fwd(x, w):
  return _bf16_matmul(x, w), (x, w)


def _bf16_matmul_bwd(saved, g):
  x, w = saved
  g = g.astype(x.dtype)
  dx = _matmul_sums(g, w, g.ndim - 1, 1).astype(x.dtype)  # [..., out] . [in, out] -> [..., in]
  rows = tuple(range(x.ndim - 1))
  dw = jax.lax.dot_general(x, g, ((rows, rows), ((), ())), preferred_element_type=jnp.float32)
  return dx, dw.astype(w.dtype)


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def attention_implementation(dtype) -> str:
  """How attention runs (`BertSelfAttention`): "cudnn" (cuDNN's fused flash attention, through
  `jax.nn.dot_product_attention`) when `DPJAX_ATTENTION=cudnn` is set on a GPU and the compute
  dtype is bfloat16 or float16; "pallas" (`dpjax.models.flash_attention`: flash attention with
  the attention dropout inside the kernel) when `DPJAX_ATTENTION=pallas` is set on a GPU with
  those dtypes; "cpu" (`_cpu_attention`) on a CPU unless `DPJAX_ATTENTION=xla` asks for
  `jax.nn.dot_product_attention` there; else "xla" (JAX's own choice for `implementation=None`
  is XLA too). Both kernels are opt-in. cuDNN runs only where nothing needs the probabilities
  (no attention dropout): it made the bf16 train step without dropout faster than XLA on an
  H200 (results/speed_gpu.md); the dump and search with it are unmeasured. The Pallas kernel
  takes dropout too, and made the recipe's bf16 step with dropout faster than XLA on an H100
  (results/speed_gpu.md; sizes it does not take, e.g. one query, run as "xla"); opt-in until its
  remaining GPU tests and a full training have run there."""
  asked = os.environ.get("DPJAX_ATTENTION")
  if asked not in (None, "xla", "cudnn", "pallas"):
    raise ValueError(f"DPJAX_ATTENTION={asked!r}: must be xla, cudnn or pallas")
  backend = jax.default_backend()
  if (asked in ("cudnn", "pallas") and backend == "gpu"
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)):
    return asked
  return "cpu" if backend == "cpu" and asked is None else "xla"


# `_cpu_attention` takes batches whose float32 scores exceed the first size in chunks of rows
# whose scores fit the second (one row at a time at least): larger arrays leave the caches.
CPU_ATTENTION_CHUNKING = (24 << 20, 8 << 20)


def _cpu_attention(q, k, v, attention_bias, dtype, dropout=None):
  """Softmax attention of q [B, Lq, H, Dh] over k, v [B, L, H, Dh] as XLA:CPU runs it fastest:
  heads moved ahead of the products, scores in float32, the softmax's division deferred to the
  [B, H, Lq, Dh] context instead of the [B, H, Lq, L] weights (the exponentials' sums are taken
  all the same), and large batches in chunks of rows (`CPU_ATTENTION_CHUNKING`; not with
  dropout); faster there than `jax.nn.dot_product_attention` (results/code_measurements.md).
  `dropout(weights)`: dropout on the unnormalised weights, the same as on the probabilities.
  Products of bfloat16 sum into float32 (`_float32_sums`)."""
  batch, num_queries, heads, head_dim = q.shape
  row_bytes = 4 * heads * num_queries * k.shape[1]
  too_big, fits = CPU_ATTENTION_CHUNKING
  if dropout is None and batch * row_bytes > too_big:
    rows = max([n for n in range(1, batch + 1) if batch % n == 0 and n * row_bytes <= fits],
               default=1)  # rows per chunk: a divisor of the batch
    if rows < batch:
      bias = jnp.broadcast_to(attention_bias, (batch, *attention_bias.shape[1:]))
      chunks = [x.reshape(batch // rows, rows, *x.shape[1:]) for x in (q, k, v, bias)]
      out = jax.lax.map(lambda xs: _softmax_attention(*xs, dtype), chunks)
      return out.reshape(q.shape)
  return _softmax_attention(q, k, v, attention_bias, dtype, dropout)


def _softmax_attention(q, k, v, attention_bias, dtype, dropout=None):
  """Softmax attention with the [B, H, Lq, L] weights materialised (what dropout on them needs):
  float32 scores and sums, the division by the exponentials' sums deferred to the context.
  `_cpu_attention`'s rows, and the accelerators' path under dropout."""
  qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, H, L, Dh]
  scores = jnp.einsum("bhqd,bhkd->bhqk", qt, kt, preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(q.shape[-1])) + attention_bias
  # Shifted by the row's maximum (no gradient: the result does not depend on it).
  weights = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  total = weights.sum(-1, keepdims=True)  # [B, H, Lq, 1]
  if dropout is not None:
    weights = dropout(weights)
  context = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(dtype), vt,
                       preferred_element_type=jnp.float32) / total
  return context.transpose(0, 2, 1, 3).astype(dtype)  # [B, Lq, H, Dh]


def _fused_attention(q, k, v, attention_bias, implementation: str | None = None):
  """Attention of q [B, Lq, H, Dh] over k, v [B, L, H, Dh] with the additive padding mask
  [B, 1, 1, L], no [B, H, Lq, L] probabilities kept for the backward pass. The cuDNN kernel
  takes the mask as key lengths (the real tokens of every row come first: windows and
  questions are padded at the end), at least 1 so that an all-padding row stays finite.
  `implementation="lengths"`: that formulation run by XLA (what the tests compare on a CPU)."""
  implementation = implementation or attention_implementation(q.dtype)
  if implementation == "cudnn" and (q.shape[1] % 2 or k.shape[1] % 2):
    # cuDNN's padding-masked kernel refuses odd lengths in training (NotImplementedError
    # "Unsupported sequence length Q 1, KV 64": the question encoders' last layer, `first_only`,
    # has one query; seen on an H200): XLA runs those calls, the same formulation.
    implementation = "lengths"
  if implementation == "xla":
    # (float32's lowest bias is -inf in bfloat16: an all-padding row's softmax would be NaN)
    bias = jnp.maximum(attention_bias, jnp.finfo(q.dtype).min).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias)
  return jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=_key_lengths(attention_bias),
      implementation=None if implementation == "lengths" else implementation)


def _key_lengths(attention_bias) -> jax.Array:
  """The real keys of each row [B] (int32, at least 1) of an additive padding mask [B, 1, 1, L]
  whose real tokens come first."""
  return jnp.maximum((attention_bias[:, 0, 0, :] == 0).sum(-1), 1).astype(jnp.int32)


def _dense(config: BertConfig, in_features: int, out_features: int, dtype, rngs: nnx.Rngs):
  init = nnx.initializers.truncated_normal(stddev=config.initializer_range)
  return nnx.Linear(in_features, out_features, kernel_init=init, dtype=dtype, rngs=rngs,
                    dot_general=_dot_general)


def _layer_norm(config: BertConfig, rngs: nnx.Rngs):
  return nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps,
                       dtype=jnp.float32, rngs=rngs)


class BertEmbeddings(nnx.Module):
  """Sum of word, position and token-type embeddings, then LayerNorm and dropout."""

  def __init__(self, config: BertConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    init = nnx.initializers.truncated_normal(stddev=config.initializer_range)
    self.word_embeddings = nnx.Embed(config.vocab_size, config.hidden_size,
                                     embedding_init=init, rngs=rngs)
    self.position_embeddings = nnx.Embed(config.max_position_embeddings, config.hidden_size,
                                         embedding_init=init, rngs=rngs)
    self.token_type_embeddings = nnx.Embed(config.type_vocab_size, config.hidden_size,
                                           embedding_init=init, rngs=rngs)
    self.layer_norm = _layer_norm(config, rngs)
    self.dropout = Dropout(config.hidden_dropout_prob)
    self.dtype = dtype

  def __call__(self, input_ids, token_type_ids, *, rngs: nnx.Rngs | None = None,
               position_ids=None):
    # input_ids, token_type_ids: [B, L] int; position_ids [B, L] int, None: 0..L-1 in each row
    if position_ids is None:
      width, positions = input_ids.shape[-1], self.position_embeddings.num_embeddings
      if width > positions:  # (at trace time) positions past the table embed as NaN (jnp.take)
        raise ValueError(f"inputs {width} tokens wide exceed the encoder's {positions} "
                         "positions")
      position_ids = jnp.arange(width)[None, :]
    x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
         + self.token_type_embeddings(token_type_ids))
    x = self.layer_norm(x)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    return x.astype(self.dtype)  # [B, L, D]


class BertSelfAttention(nnx.Module):
  """Multi-head self-attention with its output projection, residual and LayerNorm."""

  def __init__(self, config: BertConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    d = config.hidden_size
    self.num_heads = config.num_attention_heads
    self.query = _dense(config, d, d, dtype, rngs)
    self.key = _dense(config, d, d, dtype, rngs)
    self.value = _dense(config, d, d, dtype, rngs)
    self.output = _dense(config, d, d, dtype, rngs)
    self.layer_norm = _layer_norm(config, rngs)
    self.attention_dropout = Dropout(config.attention_probs_dropout_prob)
    self.output_dropout = Dropout(config.hidden_dropout_prob)
    self.dtype = dtype

  def __call__(self, hidden, attention_bias, *, rngs: nnx.Rngs | None = None,
               num_queries: int | None = None, query_positions=None):
    # hidden: [B, L, D]; attention_bias: [B, 1, 1, L] float32 (0 or a large negative), or
    # [B, 1, L, L] (each query's own keys: packed rows, `BertModel`'s segment_ids).
    # num_queries: only the first positions attend (and are returned), [B, num_queries, D];
    # query_positions [B, S] int: only those positions, [B, S, D].
    batch, _, d = hidden.shape
    head_dim = d // self.num_heads
    attending, attention_bias = _attending(hidden, attention_bias, num_queries, query_positions)

    def heads(x):  # [B, L, D] -> [B, L, H, D/H]
      return x.reshape(batch, x.shape[1], self.num_heads, head_dim)

    q, k, v = heads(self.query(attending)), heads(self.key(hidden)), heads(self.value(hidden))
    dropout = rngs is not None and self.attention_dropout.rate > 0
    drop = ((lambda w: self.attention_dropout(w, deterministic=False, rngs=rngs))
            if dropout else None)
    implementation = attention_implementation(self.dtype)
    if attention_bias.shape[2] > 1 and implementation in ("cudnn", "pallas"):
      implementation = "xla"  # the kernels take key lengths: one mask for all of a row's queries
    if (implementation == "pallas" and self.attention_dropout.rate < 1.0
        and flash_attention.supported(q.shape[1], k.shape[1], batch, self.num_heads, head_dim)):
      context = flash_attention.flash_attention(
          q, k, v, _key_lengths(attention_bias),
          self.attention_dropout.seed(rngs) if dropout else None,
          rate=self.attention_dropout.rate if dropout else 0.0,
          tuning=flash_attention.tuning_from_env().fitted(q.shape[1], k.shape[1]))
    elif implementation == "cpu":
      context = _cpu_attention(q, k, v, attention_bias, self.dtype, dropout=drop)
    elif not dropout and not _float32_sums(self.dtype):
      context = _fused_attention(q, k, v, attention_bias,
                                 "xla" if implementation == "pallas" else implementation)
    else:  # dropout on the attention probabilities needs them materialised (and XLA:CPU's
      # kernel would sum bfloat16 products into bfloat16)
      context = _softmax_attention(q, k, v, attention_bias, self.dtype, drop)
    context = context.reshape(attending.shape)
    out = self.output_dropout(self.output(context), deterministic=rngs is None, rngs=rngs)
    return self.layer_norm(out + attending).astype(self.dtype)  # [B, L or num_queries, D]


def _attending(hidden, attention_bias, num_queries: int | None, query_positions):
  """(the rows of `hidden` that attend, their rows of a per-query `attention_bias`): all of them,
  the first `num_queries`, or those at `query_positions` [B, S]."""
  per_query = attention_bias.shape[2] > 1
  if query_positions is not None:
    rows = jnp.take_along_axis(hidden, query_positions[:, :, None], axis=1)
    if per_query:
      attention_bias = jnp.take_along_axis(attention_bias, query_positions[:, None, :, None],
                                           axis=2)
    return rows, attention_bias
  if num_queries is not None:
    return hidden[:, :num_queries], attention_bias[:, :, :num_queries]
  return hidden, attention_bias


class BertLayer(nnx.Module):
  """Post-LN transformer layer: attention block, then GELU feed-forward block."""

  def __init__(self, config: BertConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.attention = BertSelfAttention(config, dtype=dtype, rngs=rngs)
    self.intermediate = _dense(config, config.hidden_size, config.intermediate_size, dtype, rngs)
    self.output = _dense(config, config.intermediate_size, config.hidden_size, dtype, rngs)
    self.layer_norm = _layer_norm(config, rngs)
    self.dropout = Dropout(config.hidden_dropout_prob)
    self.activation = _ACTIVATIONS[config.hidden_act]
    self.dtype = dtype

  def __call__(self, hidden, attention_bias, *, rngs: nnx.Rngs | None = None,
               num_queries: int | None = None, query_positions=None):
    # hidden: [B, L, D]; attention_bias, num_queries, query_positions as in BertSelfAttention
    attended = self.attention(hidden, attention_bias, rngs=rngs, num_queries=num_queries,
                              query_positions=query_positions)
    ff = self.output(self.activation(self.intermediate(attended)))
    ff = self.dropout(ff, deterministic=rngs is None, rngs=rngs)
    return self.layer_norm(ff + attended).astype(self.dtype)  # [B, L or num_queries, D]


class BertModel(nnx.Module):
  """BERT encoder returning the last layer's token vectors (no pooler).

  Dropout is active exactly when `rngs` (with a `dropout` stream) is passed to `__call__`;
  without it the forward pass is deterministic, as in evaluation.
  """

  def __init__(self, config: BertConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.embeddings = BertEmbeddings(config, dtype=dtype, rngs=rngs)
    self.layers = nnx.List([BertLayer(config, dtype=dtype, rngs=rngs)
                            for _ in range(config.num_hidden_layers)])

  def __call__(
      self,
      input_ids,  # [B, L] int
      attention_mask=None,  # [B, L] {0, 1}; None means no padding
      token_type_ids=None,  # [B, L] int; None means all zeros
      *,
      rngs: nnx.Rngs | None = None,
      first_only: bool = False,
      segment_ids=None,  # [B, L] int: packed rows, see below
      position_ids=None,  # [B, L] int; None means 0..L-1 in every row
      query_positions=None,  # [B, S] int: the only outputs wanted, see below
  ):
    """Returns the last hidden states, [B, L, D] in the compute dtype; with `first_only` only
    the first position's, [B, 1, D]: the last layer computes the other positions' keys and values
    only (less work for [CLS] readers such as the question encoders; results/speed.md times the
    train step that uses it), and the values
    equal the full pass's first row; with `query_positions` those positions' likewise, [B, S, D].

    Packed rows (several sequences in one row, no padding between them): `segment_ids` numbers
    each token's sequence (> 0; 0 marks padding) and a token attends to its own sequence's tokens
    only; with `position_ids` counting from 0 in each sequence, every sequence's vectors are
    those of its own row (up to float rounding)."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    # Additive mask as in BertModel: padded keys get the most negative float32, so their
    # softmax weight is exactly 0 for every row that has at least one real token.
    keep = attention_mask.astype(bool)[:, None, None, :]
    if segment_ids is not None:  # [B, 1, L, L]: a query's keys are its segment's tokens
      keep = keep & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]) & (
          segment_ids[:, None, None, :] > 0)
    attention_bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
    hidden = self.embeddings(input_ids, token_type_ids, rngs=rngs, position_ids=position_ids)
    last = len(self.layers) - 1
    for i, layer in enumerate(self.layers):
      hidden = layer(hidden, attention_bias, rngs=rngs,
                     num_queries=1 if first_only and i == last else None,
                     query_positions=query_positions if i == last else None)
    return hidden
