"""The NNX BERT encoder against a plain-numpy BERT forward pass, on a tiny odd-sized config."""
import dataclasses
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpjax.models.bert import BertConfig, BertModel

CONFIG = BertConfig(vocab_size=53, hidden_size=21, num_hidden_layers=3, num_attention_heads=3,
                    intermediate_size=37, max_position_embeddings=17, type_vocab_size=2,
                    layer_norm_eps=1e-12)


def _params(model):
  return {path: np.asarray(var[...]) for path, var in nnx.iter_graph(model)
          if isinstance(var, nnx.Param)}


def _numpy_bert(p, config, ids, mask, types):
  """BERT forward in plain numpy (float64), following the original paper's definition."""
  erf = np.vectorize(math.erf)

  def layer_norm(x, prefix):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + config.layer_norm_eps) * p[(*prefix, "scale")] + \
        p[(*prefix, "bias")]

  def dense(x, prefix):
    return x @ p[(*prefix, "kernel")] + p[(*prefix, "bias")]

  b, length = ids.shape
  x = (p[("embeddings", "word_embeddings", "embedding")][ids]
       + p[("embeddings", "position_embeddings", "embedding")][np.arange(length)][None]
       + p[("embeddings", "token_type_embeddings", "embedding")][types])
  x = layer_norm(x, ("embeddings", "layer_norm"))
  h = config.num_attention_heads
  dh = config.hidden_size // h
  for i in range(config.num_hidden_layers):
    att = ("layers", i, "attention")
    split = lambda t: t.reshape(b, length, h, dh).transpose(0, 2, 1, 3)
    q, k, v = (split(dense(x, (*att, n))) for n in ("query", "key", "value"))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    scores = np.where(mask[:, None, None, :] > 0, scores, -1e30)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    context = (weights @ v).transpose(0, 2, 1, 3).reshape(b, length, -1)
    x = layer_norm(dense(context, (*att, "output")) + x, (*att, "layer_norm"))
    inner = dense(x, ("layers", i, "intermediate"))
    inner = 0.5 * inner * (1 + erf(inner / math.sqrt(2)))
    x = layer_norm(dense(inner, ("layers", i, "output")) + x, ("layers", i, "layer_norm"))
  return x


def _inputs(seed=0, batch=3, length=13):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, CONFIG.vocab_size, (batch, length)).astype(np.int32)
  lengths = np.array([length, 7, 2])[:batch]
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask > 0, ids, 0)
  types = (np.arange(length)[None] >= 4).astype(np.int32) * mask
  return ids, mask, types


@pytest.fixture(scope="module")
def model():
  m = BertModel(CONFIG, rngs=nnx.Rngs(7))
  # Random (non-trivial) LayerNorm parameters, so the test covers them too.
  rng = np.random.default_rng(3)
  for path, var in nnx.iter_graph(m):
    if isinstance(var, nnx.Param) and path[-1] in ("scale", "bias"):
      var[...] = jnp.asarray(rng.normal(1.0 if path[-1] == "scale" else 0.0, 0.1, var.shape),
                             jnp.float32)
  return m


def test_matches_numpy_bert(model):
  ids, mask, types = _inputs()
  ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types)))
  ref = _numpy_bert({k: v.astype(np.float64) for k, v in _params(model).items()}, CONFIG,
                    ids, mask, types)
  real = mask.astype(bool)
  assert ours.shape == (3, 13, CONFIG.hidden_size)
  np.testing.assert_allclose(ours[real], ref[real], atol=2e-5, rtol=0)


def test_padding_does_not_change_real_tokens(model):
  ids, mask, types = _inputs()
  short = model(jnp.asarray(ids[1:2, :7]), jnp.asarray(mask[1:2, :7]), jnp.asarray(types[1:2, :7]))
  padded = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
  np.testing.assert_allclose(np.asarray(padded)[1, :7], np.asarray(short)[0], atol=1e-5)


def test_dropout_only_with_rngs(model):
  ids, mask, types = (jnp.asarray(a) for a in _inputs())
  plain = model(ids, mask, types)
  np.testing.assert_array_equal(plain, model(ids, mask, types))
  noisy = model(ids, mask, types, rngs=nnx.Rngs(dropout=1))
  again = model(ids, mask, types, rngs=nnx.Rngs(dropout=1))
  other = model(ids, mask, types, rngs=nnx.Rngs(dropout=2))
  np.testing.assert_array_equal(noisy, again)
  assert not np.allclose(noisy, plain)
  assert not np.allclose(noisy, other)


def test_bfloat16_compute_tracks_float32(model):
  ids, mask, types = (jnp.asarray(a) for a in _inputs())
  fp32 = np.asarray(model(ids, mask, types))
  bf16_model = BertModel(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  nnx.update(bf16_model, nnx.state(model, nnx.Param))
  bf16 = bf16_model(ids, mask, types)
  assert bf16.dtype == jnp.bfloat16
  assert all(v.dtype == jnp.float32 for v in _params(bf16_model).values())  # fp32 params
  real = np.asarray(mask).astype(bool)
  # bf16 has an 8-bit mantissa: after 3 layers the LayerNorm-scaled outputs (~unit scale) agree
  # to a few hundredths.
  assert np.abs(np.asarray(bf16, np.float32) - fp32)[real].max() < 0.1


@pytest.mark.parametrize("dropout", [False, True])
def test_bfloat16_products_sum_in_float32_on_cpu(model, dropout):
  """XLA:CPU runs bfloat16-out matrix products ~3x slower than bfloat16-in, float32-out ones:
  every bfloat16 product of the model (dense layers, attention) sums into float32."""
  ids, mask, types = (jnp.asarray(a) for a in _inputs())
  graphdef, state = nnx.split(BertModel(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))

  def forward(state):
    rngs = nnx.Rngs(dropout=1) if dropout else None
    return nnx.merge(graphdef, state)(ids, mask, types, rngs=rngs)

  def equations(jaxpr):
    for e in jaxpr.eqns:
      yield e
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from equations(sub)
  dots = [e for e in equations(jax.make_jaxpr(forward)(state).jaxpr)
          if e.primitive.name == "dot_general"]
  bf16_dots = [e for e in dots if e.invars[0].aval.dtype == jnp.bfloat16]
  assert len(bf16_dots) >= 6 * CONFIG.num_hidden_layers - 2  # 4 + 2 dense, attention's einsums
  assert all(e.outvars[0].aval.dtype == jnp.float32 for e in bf16_dots)


def test_bfloat16_matmul_gradients_match_float32():
  """The dense layers' bf16 product (float32 sums, custom backward) against float32 autodiff."""
  from dpjax.models.bert import _bf16_matmul
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 24)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(24, 7)), jnp.bfloat16)
  # a cotangent bf16 holds exactly (the backward rounds it to bf16): the float32 reference then
  # differs only by the rounding of each result
  g = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.bfloat16).astype(jnp.float32)
  loss = lambda f: (lambda x, w: (f(x, w).astype(jnp.float32) * g).sum())
  got = jax.grad(loss(_bf16_matmul), argnums=(0, 1))(x, w)
  f32 = lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32)
  want = jax.grad(loss(f32), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2 ** -8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(_bf16_matmul(x, w), np.float32), f32(x, w),
                             rtol=2 ** -8, atol=1e-6)


def test_bfloat16_model_gradients_track_float32(model):
  ids, mask, types = (jnp.asarray(a) for a in _inputs())
  bf16_model = BertModel(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  nnx.update(bf16_model, nnx.state(model, nnx.Param))

  def grads(m):
    loss = lambda m: (m(ids, mask, types).astype(jnp.float32) ** 2).mean()
    return nnx.state(nnx.grad(loss)(m), nnx.Param)
  want, got = grads(model), grads(bf16_model)
  overall = max(np.abs(np.asarray(b)).max() for b in jax.tree.leaves(want))
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got),
                               jax.tree_util.tree_leaves_with_path(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b)
    names = [entry.key for entry in path if hasattr(entry, "key")]
    if names[-2:] == ["key", "bias"]:
      # The key bias adds the same q . b_k to every score of a query: softmax ignores it, its
      # gradient is 0 (float32: rounding only). bfloat16's rounding must stay negligible.
      assert np.abs(b).max() < 1e-9 * overall and np.abs(a).max() < 1e-4 * overall, path
      continue
    scale = np.abs(b).max() + 1e-6
    assert np.abs(a - b).max() < 0.05 * scale, path  # bf16: ~3 significant digits per product


def test_config_validation():
  with pytest.raises(ValueError, match="multiple"):
    BertConfig(hidden_size=10, num_attention_heads=3)
  with pytest.raises(ValueError, match="model_type"):
    BertConfig.from_dict({"model_type": "roberta"})
  assert BertConfig.from_dict({"hidden_size": 12, "num_attention_heads": 3,
                               "unknown_key": 1}).hidden_size == 12


def test_inputs_wider_than_the_positions_are_refused(model):
  """Positions past the table would embed as NaN (jnp.take fills out of range) and spread to
  every vector of the row: a width past max_position_embeddings (17) is refused when traced;
  packed rows (position_ids given) may be wider than the table."""
  ids = np.ones((1, CONFIG.max_position_embeddings + 1), np.int32)
  with pytest.raises(ValueError, match="18 tokens wide exceed the encoder's 17 positions"):
    model(jnp.asarray(ids), jnp.ones_like(ids), jnp.zeros_like(ids))
  fits = ids[:, :CONFIG.max_position_embeddings]
  assert np.isfinite(np.asarray(model(jnp.asarray(fits), jnp.ones_like(fits),
                                      jnp.zeros_like(fits)))).all()
  positions = np.arange(ids.shape[1])[None] % 9  # two packed sequences of 9
  assert np.isfinite(np.asarray(model(jnp.asarray(ids), jnp.ones_like(ids), jnp.zeros_like(ids),
                                      position_ids=jnp.asarray(positions)))).all()


def test_first_only_equals_the_full_pass_first_row(model):
  """`first_only` (what [CLS] readers use) skips the last layer's other rows, values unchanged,
  on the fused attention and on the materialised-probabilities (dropout) path."""
  ids, mask, types = (jnp.asarray(a) for a in _inputs())
  full = np.asarray(model(ids, mask, types))
  first = model(ids, mask, types, first_only=True)
  assert first.shape == (3, 1, CONFIG.hidden_size)
  np.testing.assert_allclose(np.asarray(first)[:, 0], full[:, 0], atol=1e-5, rtol=0)
  # Dropout that keeps (almost surely) everything: the einsum attention path, same values.
  keep_all = dataclasses.replace(CONFIG, hidden_dropout_prob=1e-9,
                                 attention_probs_dropout_prob=1e-9)
  with_dropout = BertModel(keep_all, rngs=nnx.Rngs(0))
  nnx.update(with_dropout, nnx.state(model, nnx.Param))
  first = with_dropout(ids, mask, types, rngs=nnx.Rngs(dropout=1), first_only=True)
  np.testing.assert_allclose(np.asarray(first)[:, 0], full[:, 0], atol=1e-5, rtol=0)


def test_packed_rows_equal_each_sequence_alone(model):
  """Sequences packed in one row (`segment_ids`, `position_ids` from 0 in each, padding after)
  give every token the vector it gets in its own row, and `query_positions` the rows of the
  full pass at those positions."""
  ids, mask, types = _inputs()
  lengths = mask.sum(1)  # 13, 7, 2: packed as [13 | 7 | 2 | 3 padding] and [7 | 2 | 16 padding]
  alone = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types)))
  rows = [[0, 1, 2], [1, 2]]
  width = 25
  packed = {k: np.zeros((2, width), np.int32) for k in ("ids", "types", "segments", "positions")}
  places = []
  for r, members in enumerate(rows):
    at = 0
    for s, n in enumerate(members):
      span = slice(at, at + lengths[n])
      packed["ids"][r, span], packed["types"][r, span] = ids[n, :lengths[n]], types[n, :lengths[n]]
      packed["segments"][r, span], packed["positions"][r, span] = s + 1, np.arange(lengths[n])
      places.append((r, at, n))
      at += lengths[n]
  args = [jnp.asarray(packed[k]) for k in ("ids", "segments", "types")]
  out = np.asarray(model(args[0], (args[1] > 0).astype(jnp.int32), args[2], segment_ids=args[1],
                         position_ids=jnp.asarray(packed["positions"])))
  for r, at, n in places:
    np.testing.assert_allclose(out[r, at:at + lengths[n]], alone[n, :lengths[n]], atol=1e-5,
                               rtol=0)
  assert np.isfinite(out).all()  # padding attends to nothing and stays finite
  firsts = jnp.asarray([[0, 13, 20], [0, 7, 0]])
  picked = model(args[0], (args[1] > 0).astype(jnp.int32), args[2], segment_ids=args[1],
                 position_ids=jnp.asarray(packed["positions"]), query_positions=firsts)
  assert picked.shape == (2, 3, CONFIG.hidden_size)
  np.testing.assert_allclose(np.asarray(picked), np.take_along_axis(out, np.asarray(firsts)[
      ..., None], 1), atol=1e-5, rtol=0)


def test_attention_by_key_lengths_equals_the_additive_mask(model, monkeypatch):
  """The formulation the cuDNN kernel gets (`DPJAX_ATTENTION=cudnn` on a GPU): the padding mask
  as key lengths, run here by XLA; every real token's vector and the first-only pass as with the
  additive mask (padded positions attend to the real keys either way). A row of padding only
  stays finite."""
  from dpjax.models import bert
  ids, mask, types = _inputs()
  ids, types = np.vstack([ids, ids[:1] * 0]), np.vstack([types, types[:1] * 0])
  mask = np.vstack([mask, mask[:1] * 0])  # an all-padding row, as batches padded to the devices
  args = [jnp.asarray(a) for a in (ids, mask, types)]
  by_bias = np.asarray(model(*args))
  first_bias = np.asarray(model(*args, first_only=True))
  monkeypatch.setattr(bert, "attention_implementation", lambda dtype: "lengths")
  by_lengths = np.asarray(model(*args))
  real = mask.astype(bool)
  np.testing.assert_allclose(by_lengths[real], by_bias[real], atol=1e-5, rtol=0)
  np.testing.assert_allclose(by_lengths[:3][~real[:3]], by_bias[:3][~real[:3]], atol=1e-5)
  assert np.isfinite(by_lengths).all()
  np.testing.assert_allclose(np.asarray(model(*args, first_only=True))[:3], first_bias[:3],
                             atol=1e-5, rtol=0)


def test_attention_kernels_run_only_on_a_gpu_when_asked(monkeypatch):
  from dpjax.models.bert import attention_implementation
  monkeypatch.setenv("DPJAX_ATTENTION", "cudnn")
  assert attention_implementation(jnp.bfloat16) == "xla"  # this is a CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert attention_implementation(jnp.bfloat16) == "cudnn"
  assert attention_implementation(jnp.float32) == "xla"  # cuDNN's kernel: 16-bit only
  monkeypatch.delenv("DPJAX_ATTENTION")
  assert attention_implementation(jnp.bfloat16) == "xla"
  monkeypatch.setenv("DPJAX_ATTENTION", "pallas")
  assert attention_implementation(jnp.bfloat16) == "pallas"
  assert attention_implementation(jnp.float32) == "xla"  # the Pallas kernel: 16-bit on a GPU
  monkeypatch.setenv("DPJAX_ATTENTION", "cuDNN")
  with pytest.raises(ValueError, match="DPJAX_ATTENTION='cuDNN': must be xla, cudnn or pallas"):
    attention_implementation(jnp.bfloat16)


def test_cudnn_attention_gets_only_even_lengths(monkeypatch):
  """cuDNN's padding-masked kernel refuses odd lengths (the first-only pass has one query): those
  calls go to XLA with the same key lengths, the others to cuDNN."""
  from dpjax.models import bert
  asked = []
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda q, k, v, **kw: asked.append(kw.get("implementation")) or q)
  bias = jnp.zeros((2, 1, 1, 64))
  for queries in (64, 1, 63):
    q, kv = jnp.zeros((2, queries, 2, 8)), jnp.zeros((2, 64, 2, 8))
    bert._fused_attention(q, kv, kv, bias, "cudnn")
  bert._fused_attention(jnp.zeros((2, 64, 2, 8)), jnp.zeros((2, 63, 2, 8)),
                        jnp.zeros((2, 63, 2, 8)), jnp.zeros((2, 1, 1, 63)), "cudnn")
  assert asked == ["cudnn", None, None, None]


@pytest.mark.parametrize("chunked", [False, True])
def test_cpu_attention_equals_dot_product_attention(model, monkeypatch, chunked):
  """The CPU's attention (`_cpu_attention`: deferred softmax division, chunks of rows) against
  `jax.nn.dot_product_attention` (`DPJAX_ATTENTION=xla`): every real token, the first-only pass,
  padded positions, an all-padding row, and the parameters' gradients."""
  from dpjax.models import bert
  if chunked:  # every batch in chunks of one row
    monkeypatch.setattr(bert, "CPU_ATTENTION_CHUNKING", (0, 1))
  ids, mask, types = _inputs()
  ids, types = np.vstack([ids, ids[:1] * 0]), np.vstack([types, types[:1] * 0])
  mask = np.vstack([mask, mask[:1] * 0])
  args = [jnp.asarray(a) for a in (ids, mask, types)]

  def outputs():
    loss = lambda m: (m(*args) ** 2).mean()
    return (np.asarray(model(*args)), np.asarray(model(*args, first_only=True)),
            jax.tree.leaves(nnx.state(nnx.grad(loss)(model), nnx.Param)))
  assert bert.attention_implementation(jnp.float32) == "cpu"
  cpu = outputs()
  monkeypatch.setenv("DPJAX_ATTENTION", "xla")
  assert bert.attention_implementation(jnp.float32) == "xla"
  xla = outputs()
  np.testing.assert_allclose(cpu[0], xla[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(cpu[1], xla[1], atol=1e-5, rtol=0)
  for a, b in zip(cpu[2], xla[2]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


def test_xla_attention_of_an_all_padding_row_is_finite_in_bfloat16():
  """The additive mask in bfloat16 stays finite (float32's lowest is -inf there): a row without
  real keys gives no NaN."""
  from dpjax.models.bert import _fused_attention
  q = jax.random.normal(jax.random.key(0), (2, 4, 2, 8), jnp.float32).astype(jnp.bfloat16)
  real = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0]], bool)
  bias = jnp.where(real, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]
  out = _fused_attention(q, q, q, bias, implementation="xla")
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
