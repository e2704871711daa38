"""The Pallas flash-attention kernel (Pallas' interpreter on this CPU) against the materialised
softmax attention with the same dropout masks: outputs and gradients, fp32 and bf16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpjax.models import bert, flash_attention
from dpjax.models.bert import BertConfig, BertSelfAttention, _softmax_attention
from dpjax.models.dropout import Dropout, drop_threshold, dropped, hash_bits, mask_seed
from dpjax.models.flash_attention import flash_attention as flash

LENGTHS = [96, 37, 1]  # a full row, one ending inside the second of three key blocks, one token


def _inputs(dtype=jnp.float32, batch=3, length=96, heads=2, head_dim=32, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, w = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), dtype)
                for _ in range(4))
  lengths = jnp.asarray(LENGTHS[:batch], jnp.int32)
  bias = jnp.where(jnp.arange(length)[None, :] < lengths[:, None], 0.0, -1e9)
  return q, k, v, w, lengths, bias[:, None, None, :].astype(jnp.float32)


def _both(rate: float, dtype=jnp.float32):
  """(flash, materialised) outputs and (q, k, v) gradients of sum(out * w), same masks."""
  q, k, v, w, lengths, bias = _inputs(dtype)
  key = jax.random.key(3)

  def reference(q, k, v):
    drop = (lambda x: dropped(key, x, rate)) if rate else None
    return _softmax_attention(q, k, v, bias, dtype, drop)

  def kernel(q, k, v):
    return flash(q, k, v, lengths, mask_seed(key) if rate else None, rate=rate)

  out = []
  for f in (kernel, reference):
    loss = lambda *x: (f(*x).astype(jnp.float32) * w.astype(jnp.float32)).sum()
    out.append((f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))
  return out


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_flash_attention_equals_the_materialised_softmax_with_its_dropout(rate):
  """fp32: the kernel's output and gradients are the materialised path's (dropout masks made
  from the same seed: equal element by element), to float32 rounding; keys past a row's length
  get no gradient, and a one-token row is exact."""
  (out, grads), (ref_out, ref_grads) = _both(rate)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-6, rtol=0)
  for g, r in zip(grads, ref_grads):
    scale = float(jnp.abs(r).max())
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * scale, rtol=0)
  for g in grads[1:]:  # dK, dV of padding keys
    assert not np.asarray(g)[1, 37:].any() and not np.asarray(g)[2, 1:].any()


def test_flash_attention_bf16_is_as_close_to_float32_as_the_materialised_bf16():
  """bf16 in and out (products summed in float32): the kernel's output and gradients are as
  near the fp32 result as the materialised path's in bf16 (same masks), within 10%."""
  (out16, grads16), (ref16, ref_grads16) = _both(0.1, jnp.bfloat16)
  (out32, grads32), _ = _both(0.1)
  assert out16.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads16)
  for kernel, materialised, exact in [(out16, ref16, out32), *zip(grads16, ref_grads16, grads32)]:
    err, ref_err = (np.abs(np.asarray(x, np.float32) - np.asarray(exact)).max()
                    for x in (kernel, materialised))
    assert 0 < err <= 1.1 * ref_err, (err, ref_err)


def test_flash_attention_masks_do_not_depend_on_the_blocks():
  """The masks are a hash of each probability's index: blocks of 16 x 16 drop what the default
  blocks (32 x 32 here) drop."""
  q, k, v, _, lengths, _ = _inputs()
  seed = mask_seed(jax.random.key(5))
  by_default = flash(q, k, v, lengths, seed, rate=0.5)
  by_16 = flash(q, k, v, lengths, seed, rate=0.5,
                tuning=flash_attention.Tuning(block_q=16, block_k=16))
  np.testing.assert_allclose(np.asarray(by_16), np.asarray(by_default), atol=2e-6, rtol=0)
  other = flash(q, k, v, lengths, mask_seed(jax.random.key(6)), rate=0.5)
  assert np.abs(np.asarray(other) - np.asarray(by_default)).max() > 0.1  # other seed, masks


def test_flash_attention_refuses_what_it_cannot_compute():
  q, k, v, _, lengths, _ = _inputs()
  assert flash_attention.supported(96, 96, 3, 2, 32)
  assert not flash_attention.supported(1, 96, 3, 2, 32)  # one query (the first-only pass)
  assert not flash_attention.supported(96, 96, 3, 2, 24)  # head size not a power of two
  assert not flash_attention.supported(96, 40, 3, 2, 32)  # no block divides 40
  with pytest.raises(ValueError, match="unsupported sizes"):
    flash(q[:, :1], k, v, lengths)
  with pytest.raises(ValueError, match="needs a seed"):
    flash(q, k, v, lengths, rate=0.1)
  with pytest.raises(ValueError, match=r"rate 1.0 is not in \[0, 1\)"):
    flash(q, k, v, lengths, mask_seed(jax.random.key(0)), rate=1.0)
  with pytest.raises(ValueError, match="block_k 64 must be a power of two >= 16 that divides 96"):
    flash(q, k, v, lengths, tuning=flash_attention.Tuning(block_k=64))
  # 48 divides 96, but Triton's tensor sizes are powers of two (lowered for CUDA, it raises)
  with pytest.raises(ValueError, match="block_q 48 must be a power of two"):
    flash(q, k, v, lengths, tuning=flash_attention.Tuning(block_q=48))
  # A row of 0 keys (an all-padding row) attends to its first key, as `_key_lengths` makes it.
  np.testing.assert_array_equal(np.asarray(flash(q, k, v, jnp.asarray([96, 37, 0]))),
                                np.asarray(flash(q, k, v, lengths)))


def test_self_attention_with_the_kernel_drops_what_the_materialised_path_drops(monkeypatch):
  """`DPJAX_ATTENTION=pallas` (forced here; on a GPU it is 16-bit only): a BERT attention block
  under the same dropout stream gives the materialised path's output and parameter gradients
  (the kernel's seed is the key the materialised dropout takes), and its first-only pass (one
  query, which the kernel does not take) runs as before."""
  config = BertConfig(hidden_size=64, num_attention_heads=2, attention_probs_dropout_prob=0.1,
                      hidden_dropout_prob=0.1)
  layer = BertSelfAttention(config, rngs=nnx.Rngs(0))
  _, _, _, _, _, bias = _inputs()
  hidden = jnp.asarray(np.random.default_rng(1).normal(size=(3, 96, 64)), jnp.float32)

  def run(implementation):
    monkeypatch.setattr(bert, "attention_implementation", lambda dtype: implementation)

    def loss(layer):
      out = layer(hidden, bias, rngs=nnx.Rngs(dropout=7))
      return (out * jnp.cos(jnp.arange(64.0))).sum(), out
    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    first = layer(hidden, bias, rngs=nnx.Rngs(dropout=7), num_queries=1)
    return out, grads, first

  out, grads, first = run("pallas")
  ref_out, ref_grads, ref_first = run("xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=0)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(ref_first))
  assert not np.allclose(np.asarray(out), np.asarray(layer(hidden, bias)), atol=1e-3)  # dropped


def test_dropout_seed_is_the_key_its_call_takes():
  """`Dropout.seed(rngs)` is the seed of the mask `Dropout(rngs=...)` draws from the same stream."""
  x = jnp.ones((4, 8))
  dropped = Dropout(0.5)(x, rngs=nnx.Rngs(dropout=2))
  seed = Dropout(0.5).seed(nnx.Rngs(dropout=2))
  np.testing.assert_array_equal(np.asarray(dropped) != 0,
                                np.asarray(hash_bits(seed, x.shape) >= drop_threshold(0.5)))
  assert 0 < (np.asarray(dropped) == 0).sum() < x.size


@pytest.mark.parametrize("length", [384, 48])
def test_flash_attention_lowers_to_triton_for_a_gpu(length, monkeypatch):
  """The train step's shapes (48 x 384 passages, questions of 48: 12 heads of 32, bf16, with
  dropout), forward and backward, lowered for CUDA from this CPU (`jax.export`): Pallas' Triton
  lowering takes every operation of the three kernels, and each kernel's Triton module passes
  MLIR's verifier (what the GPU's parser checks first: an H100 rejected a loop bound of type i1
  that the lowering alone let through)."""
  from jax import export
  from jax._src.pallas.triton import lowering
  verified, lower = [], lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    result.module.operation.verify()  # raises MLIRError naming the op that fails
    verified.append(result)
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  q = jax.ShapeDtypeStruct((48, length, 12, 32), jnp.bfloat16)
  lengths, seed = jax.ShapeDtypeStruct((48,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.uint32)

  def loss(q, k, v, lengths, seed):
    return flash(q, k, v, lengths, seed, rate=0.1, interpret=False).astype(jnp.float32).sum()

  # The GPU to lower for: JAX 0.11's Triton lowering reads it from the abstract mesh's device and
  # refuses without one on a CPU (0.10 took compute capability 9.0 by itself).
  gpu = jax.sharding.AbstractDevice("NVIDIA H100", None, "gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
    lowered = export.export(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(q, q, q, lengths, seed).mlir_module()
  for kernel in ("dpjax_flash_forward", "dpjax_flash_backward_kv", "dpjax_flash_backward_q"):
    assert f'name = "{kernel}"' in lowered
  assert lowered.count("__gpu$xla.gpu.triton") == 3
  assert len(verified) == 3


def test_flash_attention_data_parallel_equals_one_device():
  """The batch sharded over the 8 test devices (the train step's data parallelism): the kernels
  run on each device's rows (no all-gather of the batch in the compiled program) and give the
  one-device output and gradients, dropout masks included (each row's global index)."""
  from dpjax.parallel import batch_sharding, make_mesh
  if jax.device_count() < 8:  # e.g. one GPU (gpu_speed.sh's flash_tests)
    pytest.skip("needs 8 devices")
  rng = np.random.default_rng(2)
  q, k, v, w = (jnp.asarray(rng.normal(size=(8, 32, 2, 16)), jnp.float32) for _ in range(4))
  lengths = jnp.asarray(rng.integers(1, 33, 8), jnp.int32)
  seed = mask_seed(jax.random.key(4))

  def step(q, k, v, lengths):
    loss = lambda q, k, v: (flash(q, k, v, lengths, seed, rate=0.2) * w).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  one = jax.jit(step)(q, k, v, lengths)
  sharding = batch_sharding(make_mesh(8))
  args = [jax.device_put(x, sharding) for x in (q, k, v, lengths)]
  sharded = jax.jit(step, out_shardings=(None, (sharding,) * 3))
  many = sharded(*args)
  for a, b in zip(jax.tree.leaves(many), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  assert "all-gather" not in sharded.lower(*args).compile().as_text()


def test_flash_tuning_from_the_environment(monkeypatch):
  """`DPJAX_FLASH_TUNING` names the model's launch settings as the benchmark names them; a block
  that does not divide a width is left to the default there."""
  monkeypatch.delenv("DPJAX_FLASH_TUNING", raising=False)
  assert flash_attention.tuning_from_env() == flash_attention.Tuning()
  monkeypatch.setenv("DPJAX_FLASH_TUNING", "128x0x8x3")
  tuning = flash_attention.tuning_from_env()
  assert tuning == flash_attention.Tuning(block_q=128, block_k=None, num_warps=8, num_stages=3)
  assert tuning.fitted(384, 384).block_q == 128 and tuning.fitted(48, 48).block_q is None
  monkeypatch.setenv("DPJAX_FLASH_TUNING", "128x64")
  with pytest.raises(ValueError, match="DPJAX_FLASH_TUNING='128x64': expected BQxBKxWARPSxSTAGES"):
    flash_attention.tuning_from_env()
