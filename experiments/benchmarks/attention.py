"""Attention alone, forward + backward, as the train step runs it: the Pallas flash kernel's
launch settings against XLA's materialised softmax (and cuDNN without dropout, on a GPU).

One layer's self-attention of the recipe's passages (48 x 384, 12 heads of 32, bf16, dropout 0.1,
rows of 192 to 384 real tokens), the gradient of sum(out * w) with respect to q, k and v, timed
as the median of `--steps` calls after compiling. Each flash setting (`--tunings`, query block x
key block x warps x stages) is checked against the materialised path with the same dropout
masks (largest |difference| of the output and the gradients, relative to their largest value):
a setting that fails to compile or disagrees is reported so, not timed; `best` names the fastest
of the others (`DPJAX_FLASH_TUNING` takes it). Run it where the time
goes: on a GPU (`gpu_speed.sh` stage `attention`); on a CPU the kernel runs in Pallas'
interpreter (`--small` shapes: a smoke run, not a timing).

  python experiments/benchmarks/attention.py --out OUT/attention.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
# The largest difference, as a share of the largest value, that still agrees: bf16 against bf16
# in other summation orders differs far less (results/speed_gpu.md), a wrong mask, scale or block
# by the order of the values themselves.
DISAGREES = 0.05
TUNINGS = ["64x64x4x2", "128x64x4x2", "64x128x4x2", "128x128x8x2", "64x64x4x3", "128x64x8x3",
           "32x64x4x2"]


def _inputs(batch: int, length: int, heads: int, head_dim: int):
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(0)
  q, k, v, w = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.bfloat16)
                for _ in range(4))
  lengths = jnp.asarray(rng.integers(length // 2, length + 1, batch), jnp.int32)
  bias = jnp.where(jnp.arange(length)[None, :] < lengths[:, None], 0.0, -1e9)
  return q, k, v, w, lengths, bias[:, None, None, :].astype(jnp.float32)


def _timed(fn, args, steps: int) -> dict:
  """Median seconds of `fn(*args)` (jitted: compiled first, untimed)."""
  import jax
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return {"ms": 1e3 * statistics.median(times), "compile_s": compile_s}


def _step(attention, w):
  """jit of (out, d q, d k, d v) of sum(attention(q, k, v) * w)."""
  import jax
  import jax.numpy as jnp

  def loss(q, k, v):
    out = attention(q, k, v)
    return (out.astype(jnp.float32) * w.astype(jnp.float32)).sum(), out
  return jax.jit(lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v))


def _max_rel_diff(a, b) -> float:
  import jax
  import numpy as np
  return max(float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max()
                   / max(float(np.abs(np.asarray(y, np.float32)).max()), 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run(args) -> dict:
  import jax
  from dpjax.models.bert import _fused_attention, _softmax_attention
  from dpjax.models.dropout import dropped, mask_seed
  from dpjax.models.flash_attention import Tuning, flash_attention
  q, k, v, w, lengths, bias = _inputs(args.batch, args.length, args.heads, args.head_dim)
  key, rate = jax.random.key(1), args.rate

  def materialised(q, k, v):
    return _softmax_attention(q, k, v, bias, q.dtype, lambda x: dropped(key, x, rate))
  reference = _step(materialised, w)
  out = {"device": str(jax.devices()[0].device_kind), "shape": list(q.shape), "rate": rate,
         "xla_materialised": _timed(reference, (q, k, v), args.steps)}
  expected = reference(q, k, v)
  if jax.default_backend() == "gpu":  # cuDNN's kernel, without dropout: the bound to beat
    out["cudnn_no_dropout"] = _timed(_step(
        lambda q, k, v: _fused_attention(q, k, v, bias, "cudnn"), w), (q, k, v), args.steps)
  for name in args.tunings:
    bq, bk, warps, stages = (int(x) for x in name.split("x"))
    tuning = Tuning(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
    step = _step(lambda q, k, v, t=tuning: flash_attention(
        q, k, v, lengths, mask_seed(key), rate=rate, tuning=t), w)
    try:
      start = time.perf_counter()
      result = {"max_rel_diff": _max_rel_diff(step(q, k, v), expected),
                "compile_s": time.perf_counter() - start}
      if result["max_rel_diff"] > DISAGREES:
        result["error"] = "disagrees with the materialised path"
      else:
        result["ms"] = _timed(step, (q, k, v), args.steps)["ms"]
    except Exception as e:  # a setting Triton refuses: reported, the others still run
      result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out[f"flash_{name}"] = result
    print(name, result, flush=True)
  timed = {name: out[f"flash_{name}"]["ms"] for name in args.tunings
           if "ms" in out[f"flash_{name}"]}
  # The fastest setting that agrees (DPJAX_FLASH_TUNING for the model; gpu_speed.sh's
  # step_bf16_pallas_best), None if none ran.
  out["best"] = min(timed, key=timed.get) if timed else None
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=48)
  parser.add_argument("--length", type=int, default=384)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=32)
  parser.add_argument("--rate", type=float, default=0.1)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--tunings", nargs="+",
                      help="flash settings, block_q x block_k x warps x stages (default: "
                      "TUNINGS; with --small 32x32x4x2 16x64x4x2)")
  parser.add_argument("--small", action="store_true",
                      help="2 x 64, 2 heads of 16, 2 steps (a CPU smoke run)")
  parser.add_argument("--out", help="JSON file (also printed)")
  args = parser.parse_args(argv)
  if args.small:
    args.batch, args.length, args.heads, args.head_dim, args.steps = 2, 64, 2, 16, 2
  args.tunings = args.tunings or (["32x32x4x2", "16x64x4x2"] if args.small else TUNINGS)
  sys.path.insert(0, str(REPO))
  result = run(args)
  text = json.dumps(result, indent=1)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
