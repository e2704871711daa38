"""Flash attention with dropout on the attention probabilities, the masks made inside the kernel.

BERT's attention dropout needs the [B, H, Lq, L] probabilities, so XLA materialises them (forward
and backward) and cuDNN's fused kernel, whose dropout seed JAX fixes at compile time, is not used
for it (`dpjax.models.bert`). Here a Pallas kernel (Triton on a GPU) computes attention block by
block with an online softmax (FlashAttention-2) and drops each probability where
`dpjax.models.dropout.keep_mask` would: the mask element of [b, h, i, j] is a hash of its
row-major index in the [B, H, Lq, L] array and a 64-bit seed, so the kernel makes the same mask
as the materialised path from the same seed, the backward pass remakes it instead of storing it,
and it does not depend on the block sizes.

Keys at or past a row's length (`lengths` [B]: the real tokens come first) are masked, and key
blocks wholly past it are skipped. The forward pass keeps the output and the log-sum-exp of each
query's scores [B, H, Lq] (base 2: the exponentials are exp2 of scores scaled by log2 e, GPUs'
native exponential); the backward pass recomputes the probabilities from them (one kernel for
dK and dV over key blocks, one for dQ over query blocks), with delta = rowsum(dO * O) for the
softmax's gradient, which holds with dropout (O is the dropped probabilities times V).

Opt-in on a GPU (`DPJAX_ATTENTION=pallas`, `dpjax.models.bert.attention_implementation`), 16-bit
compute only; on a CPU it runs in Pallas' interpreter (what the tests compare with the
materialised path). With the batch sharded over devices (the train step's data parallelism) each
kernel is a `custom_partitioning` op that runs on each device's rows, the masks those of the
whole batch (each row carries its global index).

JAX 0.11 deprecates Pallas' Triton backend (a DeprecationWarning at each lowering; it is still in
JAX 0.12, and setup.py keeps JAX below 0.12); its successor, Mosaic GPU, would need this kernel
rewritten. The tests pass on JAX 0.10.2 and 0.11.2 (the GPU image's).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as plgpu

from dpjax.models.dropout import drop_threshold, hash_bits_at

BLOCKS = (64, 32, 16)  # query and key block sizes tried, largest first (Triton's dots: >= 16)
_MASKED = -1e30  # scores of masked keys (finite: exp gives 0 without inf - inf)


@dataclasses.dataclass(frozen=True)
class Tuning:
  """The kernels' launch settings: query and key blocks (None: the largest of BLOCKS that
  divides the length) and Triton's warps and pipeline stages (JAX's own attention kernel's for
  heads of <= 64). Triton's compiler parameters also pick Pallas' Triton backend on a GPU (not
  Mosaic GPU)."""
  block_q: int | None = None
  block_k: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def fitted(self, num_queries: int, num_keys: int) -> "Tuning":
    """These settings with a block that does not divide its length (or is under 16) left to
    the default: one setting for every width a model meets."""
    fits = lambda block, length: block if block and _fits(block, length) else None
    return dataclasses.replace(self, block_q=fits(self.block_q, num_queries),
                               block_k=fits(self.block_k, num_keys))


def _fits(block: int, length: int) -> bool:
  """A block Triton can launch over `length`: a power of two (Triton's tensor sizes; Pallas'
  interpreter would take others, a GPU not), >= 16 (its dots), dividing the length."""
  return block >= 16 and block & (block - 1) == 0 and length % block == 0


def tuning_from_env() -> Tuning:
  """The launch settings named by `DPJAX_FLASH_TUNING` ("BQxBKxWARPSxSTAGES", e.g. "128x64x4x2",
  as `experiments/benchmarks/attention.py` names them; blocks of 0: the default), else the
  defaults: what the model's attention uses (`dpjax.models.bert`)."""
  text = os.environ.get("DPJAX_FLASH_TUNING")
  if not text:
    return Tuning()
  try:
    block_q, block_k, warps, stages = (int(x) for x in text.split("x"))
  except ValueError:
    raise ValueError(f"DPJAX_FLASH_TUNING={text!r}: expected BQxBKxWARPSxSTAGES, e.g. "
                     "128x64x4x2") from None
  return Tuning(block_q or None, block_k or None, warps, stages)


def supported(num_queries: int, num_keys: int, batch: int, heads: int, head_dim: int) -> bool:
  """Whether `flash_attention` takes these sizes: lengths multiples of a block, a power-of-two
  head size of 16 or more, and fewer than 2**32 probabilities (the masks' index range)."""
  return (_block(num_queries) is not None and _block(num_keys) is not None
          and head_dim >= 16 and head_dim & (head_dim - 1) == 0
          and batch * heads * num_queries * num_keys < 2 ** 32)


def _block(length: int) -> int | None:
  return next((b for b in BLOCKS if length % b == 0), None)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                    seed: jax.Array | None = None, *, rate: float = 0.0,
                    interpret: bool | None = None, tuning: Tuning = Tuning()) -> jax.Array:
  """Softmax attention of q [B, Lq, H, Dh] over k, v [B, L, H, Dh], keys from `lengths[b]` on
  masked (a row keeps at least its first key), with dropout at `rate` on the probabilities
  under `seed` (uint32[2], `Dropout.seed`): [B, Lq, H, Dh] in q's dtype. `interpret`: run Pallas'
  interpreter (default: off a GPU)."""
  batch, num_queries, heads, head_dim = q.shape
  if not supported(num_queries, k.shape[1], batch, heads, head_dim):
    raise ValueError(f"flash_attention: unsupported sizes q {q.shape}, k {k.shape} "
                     f"(see `supported`)")
  for name, block, length in (("block_q", tuning.block_q, num_queries),
                              ("block_k", tuning.block_k, k.shape[1])):
    if block is not None and not _fits(block, length):
      raise ValueError(f"flash_attention: {name} {block} must be a power of two >= 16 that "
                       f"divides {length}")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"flash_attention: dropout rate {rate} is not in [0, 1)")
  if seed is None:
    if rate > 0:
      raise ValueError("flash_attention: dropout needs a seed")
    seed = jnp.zeros(2, jnp.uint32)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  # Each row's index in the whole batch (the masks' index; sharded with the batch) and length.
  lengths = jnp.clip(lengths.astype(jnp.int32), 1, k.shape[1])  # no row of 0 keys (0 / 0)
  row = jnp.stack([jnp.arange(batch, dtype=jnp.int32), lengths], 1)
  return _attention(q, k, v, row, seed.astype(jnp.uint32), (rate, interpret, tuning))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, row, seed, static):
  return _launch("forward", static, seed, row, q, k, v)[0]


def _attention_fwd(q, k, v, row, seed, static):
  out, lse = _launch("forward", static, seed, row, q, k, v)
  return out, (q, k, v, row, seed, out, lse)


def _attention_bwd(static, saved, d_out):
  q, k, v, row, seed, out, lse = saved
  # delta[b, h, i] = sum_d dO * O: the softmax gradient's row term, [B, H, Lq]
  delta = jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))
  d_out = d_out.astype(q.dtype)
  d_k, d_v = _launch("backward_kv", static, seed, row, q, k, v, d_out, lse, delta)
  (d_q,) = _launch("backward_q", static, seed, row, q, k, v, d_out, lse, delta)
  return d_q, d_k, d_v, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


class _Sizes:
  """The static sizes a kernel needs: heads, query and key lengths, blocks, scale, dropout, and
  how it is launched (`static`: (rate, interpret, Tuning))."""

  def __init__(self, q, k, static: tuple[float, bool, Tuning]):
    self.rate, self.interpret, self.tuning = static
    _, self.num_queries, self.heads, head_dim = q.shape
    self.num_keys = k.shape[1]
    self.block_q = self.tuning.block_q or _block(self.num_queries)
    self.block_k = self.tuning.block_k or _block(self.num_keys)
    self.scale = 1.0 / math.sqrt(head_dim)
    self.threshold = drop_threshold(self.rate) if self.rate > 0 else None


def _keep(sizes: _Sizes, seed_ref, example, h, rows, cols):
  """Where the probabilities of queries `rows` x keys `cols` of head h of batch row `example`
  are kept (None: no dropout): `keep_mask`'s hash of their row-major index in [B, H, Lq, L]."""
  if sizes.threshold is None:
    return None
  base = (example * sizes.heads + h).astype(jnp.uint32) * jnp.uint32(sizes.num_queries)
  index = ((base + rows.astype(jnp.uint32))[:, None] * jnp.uint32(sizes.num_keys)
           + cols.astype(jnp.uint32)[None, :])
  return hash_bits_at(index, seed_ref[0], seed_ref[1]) >= jnp.uint32(sizes.threshold)


def _dot(a, b, **transposed):
  """a @ b (`trans_a`/`trans_b`) summed in float32; float32 operands as float32, not TF32."""
  return plgpu.dot(a, b, allow_tf32=a.dtype != jnp.float32, **transposed)


def _key_blocks(length, block_k: int):
  """The key blocks that hold a row's `length` keys (a traced ceiling division: Triton's
  lowering takes `lax.div` of the loaded length, as JAX's own attention kernel does)."""
  return jax.lax.div(length + (block_k - 1), block_k)


def _dropped(x, keep, rate: float):
  return x if keep is None else jnp.where(keep, x / jnp.float32(1.0 - rate), 0.0)


def _scores(sizes: _Sizes, q, k, cols, length):
  """Float32 scores of q [bq, Dh] against k [bk, Dh], scaled by 1/sqrt(Dh) and log2 e (for
  exp2), keys `cols` >= length masked."""
  s = _dot(q, k, trans_b=True).astype(jnp.float32) * jnp.float32(sizes.scale * math.log2(math.e))
  return jnp.where(cols[None, :] < length, s, _MASKED)


def _specs(sizes: _Sizes, head_dim: int, blocked: str):
  """BlockSpecs over a grid (blocks of `blocked` ("q" or "k"), B, H): the seed, a row's (index
  in the whole batch, key length), a blocked [B, L, H, Dh] array, a whole one, a blocked
  [B, H, L] array of per-query values, a whole one."""
  block = sizes.block_q if blocked == "q" else sizes.block_k
  whole_length = sizes.num_keys if blocked == "q" else sizes.num_queries
  return dict(
      seed=pl.BlockSpec((2,), lambda n, b, h: (0,)),
      row=pl.BlockSpec((None, 2), lambda n, b, h: (b, 0)),
      blocked=pl.BlockSpec((None, block, None, head_dim), lambda n, b, h: (b, n, h, 0)),
      whole=pl.BlockSpec((None, whole_length, None, head_dim), lambda n, b, h: (b, 0, h, 0)),
      rows_blocked=pl.BlockSpec((None, None, block), lambda n, b, h: (b, h, n)),
      rows_whole=pl.BlockSpec((None, None, whole_length), lambda n, b, h: (b, h, 0)))


# The kernels' arrays' axes for the SPMD partitioner: only the batch (b) is split across devices.
_RULES = {
    "forward": "s, b t, b i h d, b j h d, b j h d -> b i h d, b h i",
    "backward_kv": ("s, b t, b i h d, b j h d, b j h d, b i h d, b h i, b h i "
                    "-> b j h d, b j h d"),
    "backward_q": "s, b t, b i h d, b j h d, b j h d, b i h d, b h i, b h i -> b i h d",
}


def _launch(kind: str, static, seed, row, q, k, *arrays) -> list[jax.Array]:
  """Runs kernel `kind` on the inputs (seed, row, q, k, ...): on each device's rows of the batch
  when the batch is sharded (`_partitioned`)."""
  return _partitioned(kind, static)(seed, row, q, k, *arrays)


@functools.lru_cache(maxsize=None)
def _partitioned(kind: str, static):
  """Kernel `kind` as a `custom_partitioning` op: XLA's partitioner runs it on each device's
  rows of the batch (the seed whole, every other axis whole) instead of gathering the batch;
  the masks stay those of the whole batch (`row` holds each row's global index)."""
  local = functools.partial(_local, kind, static)
  op = custom_partitioning(local)

  def shardings(mesh, arg_shapes):
    spec = arg_shapes[2].sharding.spec  # q's
    batch = NamedSharding(mesh, P(spec[0] if len(spec) else None))
    return (NamedSharding(mesh, P()),) + (batch,) * (len(arg_shapes) - 1), batch

  def infer(mesh, arg_shapes, result_shape):
    return jax.tree.map(lambda _: shardings(mesh, arg_shapes)[1], result_shape)

  def partition(mesh, arg_shapes, result_shape):
    args, batch = shardings(mesh, arg_shapes)
    return mesh, local, jax.tree.map(lambda _: batch, result_shape), args

  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=_RULES[kind],  # factors in the order they first appear
                   need_replication_factors=("s", "t", "i", "h", "d", "j"))
  return op


def _local(kind: str, static, seed, row, q, k, *arrays) -> list[jax.Array]:
  """Kernel `kind` over these rows: a grid of (blocks of its blocked length, B, H)."""
  kernel, blocked, specs, outs = _KERNELS[kind]
  sizes = _Sizes(q, k, static)
  batch, _, heads, head_dim = q.shape
  spec = _specs(sizes, head_dim, blocked)
  blocks = (sizes.num_queries // sizes.block_q if blocked == "q"
            else sizes.num_keys // sizes.block_k)
  like = {"q": q, "k": k, "v": arrays[0],
          "lse": jax.ShapeDtypeStruct((batch, heads, sizes.num_queries), jnp.float32)}
  out_shape = [jax.ShapeDtypeStruct(like[n].shape, like[n].dtype) for n in _OUTPUTS[kind]]
  return pl.pallas_call(
      functools.partial(kernel, sizes), grid=(blocks, batch, heads),
      in_specs=[spec[n] for n in specs], out_specs=[spec[n] for n in outs],
      out_shape=out_shape, interpret=sizes.interpret,
      compiler_params=plgpu.CompilerParams(num_warps=sizes.tuning.num_warps,
                                           num_stages=sizes.tuning.num_stages),
      name=f"dpjax_flash_{kind}")(seed, row, q, k, *arrays)


def _forward_kernel(sizes: _Sizes, seed_ref, row_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
  n, h = pl.program_id(0), pl.program_id(2)
  example, length = row_ref[0], row_ref[1]  # the row's index in the whole batch, its keys
  q = q_ref[...]
  rows = n * sizes.block_q + jnp.arange(sizes.block_q)

  def body(j, carry):
    acc, top, total = carry
    keys = pl.ds(j * sizes.block_k, sizes.block_k)
    cols = j * sizes.block_k + jnp.arange(sizes.block_k)
    s = _scores(sizes, q, k_ref[keys, :], cols, length)
    new_top = jnp.maximum(top, s.max(-1))
    p = jnp.exp2(s - new_top[:, None])
    correction = jnp.exp2(top - new_top)
    total = total * correction + p.sum(-1)  # the softmax's sums: before dropout
    p = _dropped(p, _keep(sizes, seed_ref, example, h, rows, cols), sizes.rate)
    v = v_ref[keys, :]
    acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v).astype(jnp.float32)
    return acc, new_top, total

  start = (jnp.zeros((sizes.block_q, q.shape[-1]), jnp.float32),
           jnp.full((sizes.block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((sizes.block_q,), jnp.float32))
  acc, top, total = jax.lax.fori_loop(0, _key_blocks(length, sizes.block_k), body, start)
  o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
  lse_ref[...] = top + jnp.log2(total)  # base 2, as the scores


def _probabilities(sizes: _Sizes, seed_ref, example, h, q, k, v, d_out, lse, delta, rows, cols,
                   length):
  """(dropped probabilities, d scores) of a query block x key block in the backward pass."""
  p = jnp.exp2(_scores(sizes, q, k, cols, length) - lse[:, None])
  keep = _keep(sizes, seed_ref, example, h, rows, cols)
  d_p = _dropped(_dot(d_out, v, trans_b=True).astype(jnp.float32), keep, sizes.rate)
  return _dropped(p, keep, sizes.rate), p * (d_p - delta[:, None])


def _backward_kv_kernel(sizes: _Sizes, seed_ref, row_ref, q_ref, k_ref, v_ref, do_ref,
                        lse_ref, delta_ref, dk_ref, dv_ref):
  n, h = pl.program_id(0), pl.program_id(2)
  example, length = row_ref[0], row_ref[1]  # the row's index in the whole batch, its keys
  k, v = k_ref[...], v_ref[...]
  cols = n * sizes.block_k + jnp.arange(sizes.block_k)

  def body(i, carry):
    d_k, d_v = carry
    queries = pl.ds(i * sizes.block_q, sizes.block_q)
    rows = i * sizes.block_q + jnp.arange(sizes.block_q)
    q, d_out = q_ref[queries, :], do_ref[queries, :]
    p, d_s = _probabilities(sizes, seed_ref, example, h, q, k, v, d_out, lse_ref[queries],
                            delta_ref[queries], rows, cols, length)
    d_v = d_v + _dot(p.astype(d_out.dtype), d_out, trans_a=True).astype(jnp.float32)
    d_k = d_k + _dot(d_s.astype(q.dtype), q, trans_a=True).astype(jnp.float32)
    return d_k, d_v

  zeros = jnp.zeros(k.shape, jnp.float32)
  # every query block if this key block holds keys of the row, else none (its d k, d v are 0);
  # integer arithmetic: Triton's lowering gave a `jnp.where` of a comparison an i1 loop bound,
  # which its parser rejects ('scf.for' bounds of different types)
  real = jnp.clip(length - n * sizes.block_k, 0, 1)
  d_k, d_v = jax.lax.fori_loop(0, real * (sizes.num_queries // sizes.block_q), body,
                               (zeros, zeros))
  dk_ref[...] = (d_k * jnp.float32(sizes.scale)).astype(dk_ref.dtype)
  dv_ref[...] = d_v.astype(dv_ref.dtype)


def _backward_q_kernel(sizes: _Sizes, seed_ref, row_ref, q_ref, k_ref, v_ref, do_ref,
                       lse_ref, delta_ref, dq_ref):
  n, h = pl.program_id(0), pl.program_id(2)
  example, length = row_ref[0], row_ref[1]  # the row's index in the whole batch, its keys
  q, d_out, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  rows = n * sizes.block_q + jnp.arange(sizes.block_q)

  def body(j, d_q):
    keys = pl.ds(j * sizes.block_k, sizes.block_k)
    cols = j * sizes.block_k + jnp.arange(sizes.block_k)
    k = k_ref[keys, :]
    _, d_s = _probabilities(sizes, seed_ref, example, h, q, k, v_ref[keys, :], d_out, lse, delta,
                            rows, cols, length)
    return d_q + _dot(d_s.astype(k.dtype), k).astype(jnp.float32)

  d_q = jax.lax.fori_loop(0, _key_blocks(length, sizes.block_k), body,
                          jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (d_q * jnp.float32(sizes.scale)).astype(dq_ref.dtype)


# Each kernel's outputs (`_local`), shaped like these inputs (lse: [B, H, Lq] float32).
_OUTPUTS = {"forward": ("q", "lse"), "backward_kv": ("k", "v"), "backward_q": ("q",)}
# Each kernel (`_local`): its function, its blocked length, the `_specs` of its inputs, outputs.
_KERNELS = {
    "forward": (_forward_kernel, "q", ["seed", "row", "blocked", "whole", "whole"],
                ["blocked", "rows_blocked"]),
    "backward_kv": (_backward_kv_kernel, "k",
                    ["seed", "row", "whole", "blocked", "blocked", "whole", "rows_whole",
                     "rows_whole"], ["blocked", "blocked"]),
    "backward_q": (_backward_q_kernel, "q",
                   ["seed", "row", "blocked", "whole", "whole", "blocked", "rows_blocked",
                    "rows_blocked"], ["blocked"]),
}
