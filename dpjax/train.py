"""Training: state, optimizer, the jitted data-parallel step over a device mesh, and the loop.

One `train_step(state, batch) -> (state, metrics)` is built once: `jax.jit` over a 1-D `data`
mesh, the batch sharded on its first axis, parameters and optimizer state replicated, the state
donated, the dropout rng folded with the step inside the step. Losses are computed on the global
batch, so in-batch negatives (and the unified loss's "all tokens of the other passages") span
every device. The pre-batch queue (the token vectors of the C previous batches) is part of the
state, so it is checkpointed and restored with it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import re
import time
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from dpjax import losses
from dpjax.config import ConfigError, write_json, write_text_atomic
from dpjax.data.squad import RCFeatures
from dpjax.parallel import global_array

log = logging.getLogger(__name__)


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of every other variable
  opt_state: Any
  queue: dict  # pre-batch queue, see `init_queue`
  rng: jax.Array  # [2] uint32 base key; the step's key is fold_in(rng, step)


# ---------------------------------------------------------------------------------------------
# Optimizer


def learning_rate_schedule(peak: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to `peak`, then linear decay to 0 at `total_steps`."""
  warmup_steps = max(int(warmup_steps), 1)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup_steps),
       optax.linear_schedule(peak, 0.0, max(total_steps - warmup_steps, 1))], [warmup_steps])


def param_path(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def param_labels(params, freeze_patterns) -> Any:
  """'frozen' for parameters whose path matches any regex of `freeze_patterns`, else 'train'."""
  compiled = [re.compile(p) for p in freeze_patterns]
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if any(c.search(param_path(path)) for c in compiled)
      else "train", params)


def make_optimizer(train_config, params, total_steps: int):
  """AdamW with grad-norm clipping and warm-up + linear decay; frozen parameters get no update."""
  warmup = train_config.warmup_steps or int(train_config.warmup_fraction * total_steps)
  schedule = learning_rate_schedule(train_config.learning_rate, warmup, total_steps)
  trainable = optax.chain(optax.clip_by_global_norm(train_config.grad_clip),
                          optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8,
                                      weight_decay=train_config.weight_decay))
  labels = param_labels(params, list(train_config.freeze))
  tx = optax.multi_transform({"train": trainable, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule, labels


# ---------------------------------------------------------------------------------------------
# Pre-batch queue


def init_queue(size: int, batch_size: int, length: int, dim: int) -> dict:
  """An empty queue of `size` previous batches: all their token vectors and gold positions."""
  return {"vectors": jnp.zeros((size, batch_size, length, dim), jnp.float32),
          "mask": jnp.zeros((size, batch_size, length), bool),
          "passage_ids": jnp.full((size, batch_size), -1, jnp.int32),
          "start": jnp.zeros((size, batch_size), jnp.int32),
          "end": jnp.zeros((size, batch_size), jnp.int32),
          "valid": jnp.zeros((size,), bool)}


def push_queue(queue: dict, entry: dict) -> dict:
  """Drops the oldest batch and puts `entry` (one batch, no gradient) first."""
  if not queue:  # no pre-batch negatives
    return queue
  entry = {**jax.lax.stop_gradient(entry), "valid": jnp.ones((), bool)}
  return {k: jnp.concatenate([entry[k][None].astype(v.dtype), v[:-1]]) for k, v in queue.items()}


def queue_sharding(mesh, queue: dict) -> dict:
  if not queue:
    return {}
  batch_axis = NamedSharding(mesh, P(None, "data"))
  return {"vectors": batch_axis, "mask": batch_axis, "passage_ids": batch_axis,
          "start": batch_axis, "end": batch_axis, "valid": NamedSharding(mesh, P())}


# ---------------------------------------------------------------------------------------------
# Losses of a batch


def _log_weight(weight: float) -> float:
  return math.log(weight) if weight > 0 else losses.NEG_INF


def _qsft_loss(model, batch: dict, rngs=None):
  """Query-side fine-tuning: marginal likelihood of the positive retrieved phrases (Eq. 11), on
  phrase scores plus start-only and end-only scores (as the reference)."""
  q_start, q_end = model.encode_questions(batch["question_input_ids"],
                                          batch["question_attention_mask"], rngs=rngs)
  start = jnp.einsum("bkd,bd->bk", batch["candidate_start"], q_start)
  end = jnp.einsum("bkd,bd->bk", batch["candidate_end"], q_end)
  positive, valid = batch["candidate_positive"], batch["candidate_valid"]
  per_example = (losses.marginal_likelihood_loss(start + end, positive, valid)
                 + losses.marginal_likelihood_loss(start, positive, valid)
                 + losses.marginal_likelihood_loss(end, positive, valid))
  loss = per_example.mean()
  top1 = jnp.take_along_axis(positive, jnp.argmax(jnp.where(valid, start + end, losses.NEG_INF),
                                                  axis=1)[:, None], 1)[:, 0]
  entry = {"vectors": jnp.zeros((q_start.shape[0], 1, q_start.shape[1])),
           "mask": jnp.zeros((q_start.shape[0], 1), bool),
           "passage_ids": jnp.zeros(q_start.shape[0], jnp.int32),
           "start": jnp.zeros(q_start.shape[0], jnp.int32),
           "end": jnp.zeros(q_start.shape[0], jnp.int32)}
  return loss, ({"loss": loss, "top1_positive": top1.mean()}, entry)


def compute_loss(model, batch: dict, queue: dict, step, loss_config, rngs=None):
  """The configured recipe's loss on one (global) batch.

  Returns:
    (loss scalar, metrics dict, queue entry of this batch).
  """
  if loss_config.recipe == "qsft":
    return _qsft_loss(model, batch, rngs)
  h = model.encode_phrases(batch["input_ids"], batch["attention_mask"], rngs=rngs)  # [B, L, D]
  q_start, q_end = model.encode_questions(batch["question_input_ids"],
                                          batch["question_attention_mask"], rngs=rngs)
  mask, start, end = batch["context_mask"], batch["start_positions"], batch["end_positions"]
  pids = batch["passage_ids"]
  b, length, dim = h.shape
  start_logits = jnp.einsum("bld,bd->bl", h, q_start)
  end_logits = jnp.einsum("bld,bd->bl", h, q_end)
  if not queue:  # no pre-batch negatives (prebatch_size 0): an empty queue of this shape
    queue = init_queue(0, b, length, dim)
  queue_on = queue["valid"] & (step >= loss_config.prebatch_warmup_steps)  # [C]
  metrics = {}
  if loss_config.recipe == "unified":
    lw_prb = _log_weight(loss_config.lambda_prb or loss_config.lambda_inb)
    extra = [(queue["vectors"].reshape(-1, dim),
              (queue["mask"] & queue_on[:, None, None]).reshape(-1),
              jnp.repeat(queue["passage_ids"].reshape(-1), length),
              jnp.full(queue["mask"].size, lw_prb))]
    if "hard_input_ids" in batch:  # mined hard-negative passages, encoded with gradient
      hard = model.encode_phrases(batch["hard_input_ids"], batch["hard_attention_mask"],
                                  rngs=rngs)
      extra.append((hard.reshape(-1, dim), batch["hard_context_mask"].reshape(-1),
                    jnp.repeat(batch["hard_passage_ids"], length),
                    jnp.full(batch["hard_context_mask"].size,
                             _log_weight(loss_config.lambda_hard))))
    vectors, extra_mask, extra_pids, extra_lw = (jnp.concatenate(x) for x in zip(*extra))
    kwargs = dict(log_weight_in_passage=_log_weight(loss_config.lambda_inp),
                  log_weight_in_batch=_log_weight(loss_config.lambda_inb))
    per_example = 0.5 * (
        losses.unified_loss(q_start, h, mask, start, pids, vectors, extra_mask, extra_pids,
                            extra_lw, **kwargs)
        + losses.unified_loss(q_end, h, mask, end, pids, vectors, extra_mask, extra_pids,
                              extra_lw, **kwargs))
  elif loss_config.recipe == "original":
    single = losses.single_passage_loss(start_logits, end_logits, mask, start, end)
    rows = jnp.arange(b)
    qv = queue["vectors"]
    c_rows = jnp.arange(qv.shape[0])[:, None]
    b_rows = jnp.arange(qv.shape[1])[None, :]
    queue_valid = jnp.broadcast_to(queue_on[:, None], queue["passage_ids"].shape).reshape(-1)

    def side(queries, gold, queue_gold):
      queue_vectors = qv[c_rows, b_rows, queue_gold].reshape(-1, dim)
      queue_ids = (queue["passage_ids"] * length + queue_gold).reshape(-1)
      return losses.in_batch_loss(queries, h[rows, gold], pids * length + gold, queue_vectors,
                                  queue_ids, queue_valid)

    negatives = 0.5 * (side(q_start, start, queue["start"]) + side(q_end, end, queue["end"]))
    per_example = loss_config.weight_single * single + loss_config.weight_negatives * negatives
    metrics.update(single=single.mean(), negatives=negatives.mean())
    if "teacher_start_logits" in batch:
      distill = losses.distillation_loss(start_logits, end_logits, batch["teacher_start_logits"],
                                         batch["teacher_end_logits"], mask)
      per_example = per_example + loss_config.weight_distill * distill
      metrics["distill"] = distill.mean()
  else:
    raise ValueError(f"unknown loss recipe {loss_config.recipe!r} (unified or original)")
  if loss_config.weight_filter:
    targets = jnp.arange(length)[None, :]
    filt = losses.filter_loss(model.filter_logits(h), targets == start[:, None],
                              targets == end[:, None], mask)
    per_example = per_example + loss_config.weight_filter * filt
    metrics["filter"] = filt.mean()
  loss = per_example.mean()
  predicted = jnp.argmax(jnp.where(mask, start_logits, losses.NEG_INF), axis=1)
  metrics.update(loss=loss, start_accuracy=(predicted == start).mean())
  entry = {"vectors": h, "mask": mask, "passage_ids": pids, "start": start, "end": end}
  return loss, (metrics, entry)


# ---------------------------------------------------------------------------------------------
# The step


def state_sharding(state: TrainState, mesh) -> TrainState:
  replicated = NamedSharding(mesh, P())
  return TrainState(step=replicated, params=jax.tree.map(lambda _: replicated, state.params),
                    rest=jax.tree.map(lambda _: replicated, state.rest),
                    opt_state=jax.tree.map(lambda _: replicated, state.opt_state),
                    queue=queue_sharding(mesh, state.queue), rng=replicated)


def make_train_step(graphdef, tx, schedule, loss_config, sharding: TrainState, mesh,
                    dropout: bool = True, labels: Any = None) -> Callable:
  """Builds the jitted `train_step(state, batch) -> (state, metrics)`.

  `labels` ('train'/'frozen' per parameter, from `make_optimizer`) lets the step skip the
  gradients of frozen parameters (the optimizer ignores them anyway).
  """

  def train_step(state: TrainState, batch: dict):
    rng = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params):
      if labels is not None:
        params = jax.tree.map(lambda p, l: jax.lax.stop_gradient(p) if l == "frozen" else p,
                              params, labels)
      model = nnx.merge(graphdef, params, state.rest)
      rngs = nnx.Rngs(dropout=rng) if dropout else None
      return compute_loss(model, batch, state.queue, state.step, loss_config, rngs)

    (loss, (metrics, entry)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              queue=push_queue(state.queue, entry))
    return new_state, metrics

  return jax.jit(train_step, donate_argnums=(0,),
                 out_shardings=(sharding, NamedSharding(mesh, P())))


def init_state(model, tx, *, prebatch_size: int, batch_size: int, length: int, seed: int,
               mesh) -> tuple[Any, TrainState, TrainState]:
  """(graphdef, state placed on the mesh, its sharding)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                     opt_state=tx.init(params),
                     queue=init_queue(prebatch_size, batch_size, length,
                                      model.config.hidden_size) if prebatch_size else {},
                     rng=jax.random.PRNGKey(seed))
  sharding = state_sharding(state, mesh)
  return graphdef, global_array(state, sharding), sharding


# ---------------------------------------------------------------------------------------------
# Batches


@dataclasses.dataclass
class TrainBatches:
  """Deterministic shuffled batches of answerable features; position = global step."""

  features: RCFeatures
  batch_size: int
  seed: int
  hard_negatives: Any = None  # a `mining.HardNegatives`: adds h mined passages per example

  def __post_init__(self):
    self.usable = np.flatnonzero(self.features.start_position > 0)  # answer inside the window
    if len(self.usable) < self.batch_size:
      raise ValueError(f"only {len(self.usable)} answerable training features for a batch of "
                       f"{self.batch_size}")
    self.steps_per_epoch = len(self.usable) // self.batch_size

  def position(self, step: int) -> tuple[int, int]:
    return divmod(step, self.steps_per_epoch)

  def __call__(self, step: int, part: slice = slice(None)) -> dict[str, np.ndarray]:
    """The batch of `step`, or only its rows `part` (a process's share of the global batch)."""
    epoch, index = self.position(step)
    order = np.random.default_rng([self.seed, epoch]).permutation(self.usable)
    rows = order[index * self.batch_size:(index + 1) * self.batch_size][part]
    f, w = self.features, self.features.windows
    window = f.window_index[rows]
    question = f.question_index[rows]
    # Passage-level ids: no token of an example's passage (any window) is ever its negative.
    batch = {"input_ids": w.input_ids[window], "attention_mask": w.attention_mask[window],
             "context_mask": w.context_mask[window],
             "passage_ids": w.passage_index[window].astype(np.int32),
             "start_positions": f.start_position[rows], "end_positions": f.end_position[rows],
             "question_input_ids": f.question_input_ids[question],
             "question_attention_mask": f.question_attention_mask[question]}
    if self.hard_negatives is not None:
      batch.update(self.hard_negatives(step, question))
    return batch


# ---------------------------------------------------------------------------------------------
# The loop


def every(step: int, n: int) -> bool:
  return n > 0 and step % n == 0


class MetricsWriter:
  """Appends JSON lines to `workdir/metrics.jsonl`; on resume drops lines past the restored step.

  Only the main process (process 0) writes; the others' writers do nothing.
  """

  def __init__(self, path: pathlib.Path, resume_step: int):
    self.path = path
    self.enabled = jax.process_index() == 0
    if self.enabled and path.exists():
      kept = [line for line in path.read_text().splitlines()
              if line.strip() and json.loads(line)["step"] <= resume_step]
      write_text_atomic(path, "".join(line + "\n" for line in kept))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")


def _to_python(tree: dict) -> dict:
  return {k: float(v) for k, v in jax.device_get(tree).items()}


# Settings a resumed run may change: they do not alter the training trajectory.
RESUME_FREE = ("train.stop_at_step", "train.log_every", "train.checkpoint_every",
               "train.keep_checkpoints", "train.progress_bar", "data.dir", "model.name",
               "model.tokenizer", "model.init")


def resume_conflicts(stored: dict, config: dict) -> list[str]:
  """The `model`, `data` and `train` settings of `config` that differ from those a checkpoint
  was trained with (`stored`), as 'key: stored -> now', except the `RESUME_FREE` ones."""
  def settings(tree: dict) -> dict:
    flat = traverse_util.flatten_dict(
        {s: tree.get(s, {}) for s in ("model", "data", "train")}, sep=".")
    return {k: v for k, v in flat.items() if k not in RESUME_FREE}

  old, new = settings(stored), settings(config)
  return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
          for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


def train_and_evaluate(config, workdir: str) -> dict:
  """`run.py train`: trains, evaluates RC EM/F1 on dev, checkpoints; resumes from `workdir`."""
  from tqdm import tqdm

  from dpjax.checkpoint import Checkpointer, abstract_like
  from dpjax.data import Tokenizer, data_files, load_rc_split
  from dpjax.models import create_model
  from dpjax.parallel import batch_sharding, global_batch, local_rows, make_mesh, round_to_devices
  from dpjax.rc import evaluate_rc

  vc = config.get("validation")
  if vc and vc.corpus:
    Validator.check(vc)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  main = jax.process_index() == 0
  tc = config.train
  mesh = make_mesh(config.get("num_devices") or None)
  if tc.batch_size % mesh.size:
    raise ValueError(f"train.batch_size {tc.batch_size} must be a multiple of the "
                     f"{mesh.size} devices")
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  files = data_files(config.data, workdir)
  train = load_rc_split(files["train"], tokenizer, config.data)
  dev = load_rc_split(files["dev"], tokenizer, config.data, limit=config.eval.limit or None)
  hard = None
  if tc.hard_negatives.file:
    from dpjax.mining import HardNegatives, read_hard_negatives
    hard = HardNegatives(read_hard_negatives(tc.hard_negatives.file, train.questions),
                         train.features.windows,
                         np.array([q.passage_index for q in train.questions]),
                         tc.hard_negatives.per_example, tc.seed)
    if tc.loss.recipe != "unified":
      raise ValueError("hard negatives are a term of the unified loss (train.loss.recipe=unified)")
  batches = TrainBatches(train.features, tc.batch_size, tc.seed, hard)
  total = tc.num_steps or tc.epochs * batches.steps_per_epoch
  model = create_model(config.model)
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tx, schedule, labels = make_optimizer(tc, params, total)
  frozen = sum(x.size for x, l in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
               if l == "frozen")
  log.info("%d steps (%d per epoch, batch %d on %d devices, %d processes); %d of %d parameters "
           "frozen", total, batches.steps_per_epoch, tc.batch_size, mesh.size,
           jax.process_count(), frozen,
           sum(x.size for x in jax.tree.leaves(params)))
  graphdef, state, sharding = init_state(
      model, tx, prebatch_size=tc.loss.prebatch_size, batch_size=tc.batch_size,
      length=config.data.max_seq_length, seed=tc.seed, mesh=mesh)
  del model, params
  checkpointer = Checkpointer(workdir / "checkpoints", keep=tc.keep_checkpoints)
  restored = checkpointer.restore(abstract_like(state))
  if restored:
    state, meta = restored
    if "config" in meta:  # a resumed run must continue the same training, not another one
      conflicts = resume_conflicts(json.loads(meta["config"]), json.loads(config.to_json()))
      if conflicts:
        raise ConfigError(
            f"{workdir / 'checkpoints'} holds a run trained with other settings; resuming it "
            f"with these would silently mix two runs ({'; '.join(conflicts)}). Train into a "
            "new --workdir, or resume with the checkpoint's settings.")
  first = int(state.step)
  writer = MetricsWriter(workdir / "metrics.jsonl", first)
  step_fn = make_train_step(graphdef, tx, schedule, tc.loss, sharding, mesh, tc.dropout, labels)
  # Each process builds and transfers only its own rows of every global batch.
  mine = local_rows(batch_sharding(mesh), tc.batch_size)
  to_device = lambda step: global_batch(batches(step, mine), batch_sharding(mesh), tc.batch_size,
                                       mine.stop - mine.start)
  eval_batch = round_to_devices(config.eval.batch_size, mesh)

  def evaluate(step: int) -> dict:
    model = nnx.merge(graphdef, state.params, state.rest)
    scores, predictions = evaluate_rc(model, dev.features, dev.passages, dev.questions,
                                      mesh=mesh, batch_size=eval_batch,
                                      max_answer_length=config.eval.max_answer_length)
    record = {"step": step, "split": "dev", "rc_exact_match": scores["exact_match"],
              "rc_f1": scores["f1"], "count": scores["count"]}
    writer.write(record)
    if main:
      write_json(workdir / "rc_predictions.json", predictions)
    log.info("step %d: dev RC EM %.2f F1 %.2f (%d questions)", step, scores["exact_match"],
             scores["f1"], scores["count"])
    return record

  validator = (Validator(vc, config, workdir, files["dev"], tokenizer, mesh, eval_batch, writer)
               if vc and vc.corpus and vc.every_steps else None)
  stop = min(total, tc.stop_at_step or total)
  progress = tqdm(total=total, initial=first, desc="train", dynamic_ncols=True,
                  disable=not (tc.progress_bar and main))
  record, last_time, last_step = {}, time.perf_counter(), first
  for step in range(first, stop):
    epoch, index = batches.position(step)
    if index == 0 and step > 0 and tc.loss.clear_prebatch_each_epoch and state.queue:
      # A new epoch revisits the same passages: start the pre-batch queue afresh.
      state = state.replace(queue={**state.queue, "valid": jnp.zeros_like(state.queue["valid"])})
    state, metrics = step_fn(state, to_device(step))
    done = step + 1
    progress.update(1)
    if every(done, tc.log_every) or done == stop:
      values = _to_python(metrics)
      if not math.isfinite(values["loss"]):
        raise FloatingPointError(f"non-finite loss {values['loss']} at step {done}")
      now = time.perf_counter()
      values["examples_per_sec"] = (done - last_step) * tc.batch_size / (now - last_time)
      last_time, last_step = now, done
      writer.write({"step": done, "split": "train", "epoch": epoch, **values})
      progress.set_postfix(loss=f"{values['loss']:.3f}",
                           ex_s=f"{values['examples_per_sec']:.1f}")
    if every(done, config.eval.every_steps) or done == total:
      record = evaluate(done)
    meta = {"step": done, "epoch": batches.position(done)[0],
            "index_in_epoch": batches.position(done)[1], "config": config.to_json()}
    if validator and (every(done, validator.every_steps) or done == total):
      validator(done, nnx.merge(graphdef, state.params, state.rest), state, meta)
    if every(done, tc.checkpoint_every) or done == stop:
      checkpointer.save(done, state, meta)
      last_time = time.perf_counter()  # saving time is not training throughput
  progress.close()
  checkpointer.close()
  if first >= total and not record:
    record = evaluate(first)
  if validator:
    record = {**record, **validator.best()}
    validator.close()
  if record and main:
    write_json(workdir / "results.json", record)
  return record


class Validator:
  """Validation on a subcorpus during training (`config.validation`, Kim et al. 2022): every
  `every_steps` the subcorpus is encoded with the current parameters and indexed (exact, in
  memory), the dev questions are answered over it, and the checkpoint manager of
  `workdir/checkpoints_best` keeps the checkpoint with the best `metric` (e.g. em@1)."""

  def __init__(self, vc, config, workdir: pathlib.Path, dev_file, tokenizer, mesh, batch_size,
               writer: MetricsWriter):
    from dpjax.checkpoint import Checkpointer
    from dpjax.open_domain import read_questions
    from dpjax.validation import read_subcorpus
    self.check(vc)
    self.every_steps, self.metric = vc.every_steps, vc.metric
    self.passages = read_subcorpus(vc.corpus)
    self.questions = read_questions(vc.questions or dev_file)[:vc.limit or None]
    self.config, self.tokenizer, self.mesh = config, tokenizer, mesh
    self.batch_size, self.writer = batch_size, writer
    self.checkpointer = Checkpointer(workdir / "checkpoints_best", keep=1,
                                     best_metric=self.metric)
    self.history: dict[int, dict] = {}
    log.info("validation every %d steps on %s (%d passages, %d questions), best by %s",
             self.every_steps, vc.corpus, len(self.passages), len(self.questions), self.metric)

  @staticmethod
  def check(vc) -> None:
    """Config errors surface before any work, not after the first `every_steps` of training."""
    from dpjax.config import ConfigError
    from dpjax.validation import METRICS
    if vc.metric not in METRICS:
      raise ConfigError(f"validation.metric {vc.metric!r} is not one of {', '.join(METRICS)}")
    if not pathlib.Path(vc.corpus).is_file():
      raise ConfigError(f"validation.corpus {vc.corpus}: no such file")

  def __call__(self, step: int, model, state, meta: dict) -> dict:
    from dpjax.validation import evaluate_subcorpus
    report = evaluate_subcorpus(model, self.tokenizer, self.passages, self.questions,
                                data_config=self.config.data, mesh=self.mesh,
                                batch_size=self.batch_size,
                                max_answer_length=self.config.eval.max_answer_length)
    self.history[step] = report
    self.writer.write({"step": step, "split": "validation", **report})
    log.info("step %d: validation EM@1 %.2f EM@10 %.2f on %d passages", step, report["em@1"],
             report["em@10"], report["passages"])
    self.checkpointer.save(step, state, meta, metrics={self.metric: report[self.metric]})
    return report

  def best(self) -> dict:
    step = self.checkpointer.best_step()
    if step is None:
      return {}
    return {"best_step": step, f"best_validation_{self.metric}":
            self.history.get(step, {}).get(self.metric)}

  def close(self) -> None:
    self.checkpointer.close()
