"""The training machinery every trainer shares: state, optimizer, the one jitted data-parallel
step, and `build_trainer` (used by `run.py train`, query-side fine-tuning, tests, benchmarks).

One `train_step(state, batch) -> (state, metrics)` is built once: `jax.jit` over a 1-D `data`
mesh, the batch sharded on its first axis, parameters and optimizer state replicated, the state
donated, the dropout rng folded with the step inside the step. It takes and returns the state's
flat leaves: between steps the loop keeps those (`Trainer.advance`), and the pytree is built
only when something reads `Trainer.state` (a checkpoint, an evaluation). What is optimised is an
`Objective` (`dpjax.objectives`): a loss function of the model and the global batch, plus the
state it carries from step to step (the pre-batch queue), which is part of the train state, so it
is checkpointed and restored with it. Freezing is configuration: parameter-path regexes
(`train.freeze`) whose parameters get neither gradients nor updates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import numbers
import pathlib
import re
import signal
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

try:  # TensorBoard's event files are optional: metrics.jsonl holds every record either way
  from tensorboardX.event_file_writer import EventsWriter
  from tensorboardX.proto import event_pb2, summary_pb2
except ImportError:  # (an image without it, as a lent GPU machine's): no event files
  EventsWriter = event_pb2 = summary_pb2 = None

from dpjax.errors import ConfigError, DataError, DivergenceError
from dpjax.io import write_text_atomic
from dpjax.workdir import tensorboard_run
from dpjax.parallel import compile_at_once, compile_stats, compiles_by_function, global_array

log = logging.getLogger(__name__)
# A loss above this is divergence, not learning (the unified loss starts near log of the number
# of candidates, ~10-20).
DIVERGED_LOSS = 1e4


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # [] int32
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of every other variable
  opt_state: Any
  queue: dict  # what the objective carries between steps (the pre-batch queue), {} for none
  rng: jax.Array  # [2] uint32 base key; the step's key is fold_in(rng, step)


@dataclasses.dataclass
class Objective:
  """What a trainer optimises.

  loss_fn(model, batch, queue, step, rngs) -> (loss, (metrics, next queue)), on the global batch.
  """
  loss_fn: Callable
  queue: dict  # the initial carried state ({}: none)
  queue_sharding: Callable[[Any], dict]  # mesh -> shardings of the queue's leaves


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
  """'frozen' for parameters whose path matches any regex of `freeze_patterns`, else 'train'.
  A pattern that matches no parameter is refused (a ConfigError: nothing would be frozen)."""
  paths = [param_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  compiled = [re.compile(p) for p in freeze_patterns]
  for pattern in compiled:
    if not any(pattern.search(path) for path in paths):
      raise ConfigError(f"freeze pattern {pattern.pattern!r} matches no parameter (paths look "
                        f"like {paths[0]!r})")
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if any(c.search(param_path(path)) for c in compiled)
      else "train", params)


# Parameters AdamW's weight decay leaves alone, as the reference does (HF's `no_decay`: biases
# and LayerNorm weights).
NO_DECAY = re.compile(r"(^|/)(bias|layer_norm/scale)(/value)?$")


def decay_mask(params) -> Any:
  """True for the parameters weight decay applies to (not biases or LayerNorm scales)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not NO_DECAY.search(param_path(path)), params)


def make_optimizer(train_config, params, total_steps: int | None = None,
                   schedule: optax.Schedule | None = None):
  """AdamW with grad-norm clipping and warm-up + linear decay over `total_steps` (or
  `schedule`, a learning rate by the optimizer's count); frozen parameters get no update."""
  if (schedule is None) == (total_steps is None):
    raise ValueError("make_optimizer takes total_steps or a schedule, one of them")
  if schedule is None:
    warmup = train_config.warmup_steps or int(train_config.warmup_fraction * total_steps)
    if total_steps > 1 and warmup >= total_steps:
      raise ConfigError(f"a warm-up of {warmup} steps leaves no decay in {total_steps} steps "
                        "(train.warmup_steps / warmup_fraction)")
    schedule = learning_rate_schedule(train_config.learning_rate, warmup, total_steps)
  clip = (optax.clip_by_global_norm(train_config.grad_clip) if train_config.grad_clip > 0
          else optax.identity())
  # (no mask without decay: the optimizer state of the checkpoints written before the mask)
  trainable = optax.chain(clip, optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8,
                                            weight_decay=train_config.weight_decay,
                                            mask=decay_mask if train_config.weight_decay
                                            else None))
  labels = param_labels(params, list(train_config.freeze))
  tx = optax.multi_transform({"train": trainable, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule, labels


class Packing:
  """Which of a train state's flat leaves the step takes packed, one flat buffer per dtype: the
  optimizer's per-parameter arrays (AdamW's two moments, about two thirds of DensePhrases-
  MiniLM's 913 leaves). A jitted call's host time grows faster than its number of arrays in and
  out (results/code_measurements.md): the step's call then passes a few hundred, not ~900. The
  packing is the step's own; the train state, its checkpoints and its readers keep the leaves.
  `pack` / `unpack` (a concatenation, slices) run inside the step and, jitted, outside it when
  the state is set or read; their copies are why a CPU, whose step is not held by its host
  time, does not pack (`build_trainer`)."""

  def __init__(self, sharding: TrainState, abstract: Sequence, mesh):
    marks = sharding.replace(**{f.name: jax.tree.map(lambda _: f.name == "opt_state",
                                                     getattr(sharding, f.name))
                                for f in dataclasses.fields(sharding)})
    replicated, places = NamedSharding(mesh, P()), jax.tree.leaves(sharding)
    groups: dict = {}
    for i, (mark, leaf, place) in enumerate(zip(jax.tree.leaves(marks), abstract, places)):
      if (mark and leaf.ndim and jnp.issubdtype(leaf.dtype, jnp.floating)
              and place.is_equivalent_to(replicated, leaf.ndim)):
        groups.setdefault(jnp.dtype(leaf.dtype), []).append((i, leaf.shape))
    self.groups = list(groups.values())  # [(leaf index, shape)] per packed buffer
    packed = {i for group in self.groups for i, _ in group}
    self.kept = [i for i in range(len(abstract)) if i not in packed]
    self.count = len(abstract)
    self.shardings = (*(places[i] for i in self.kept),
                      *(replicated for _ in self.groups))

  def pack(self, leaves: Sequence) -> tuple:
    """The step's inputs: the leaves not packed, then a flat buffer per group."""
    return (*(leaves[i] for i in self.kept),
            *(jnp.concatenate([jnp.ravel(leaves[i]) for i, _ in group])
              for group in self.groups))

  def unpack(self, packed: Sequence) -> tuple:
    """The state's flat leaves from `pack`'s."""
    leaves = [None] * self.count
    for i, leaf in zip(self.kept, packed):
      leaves[i] = leaf
    for group, flat in zip(self.groups, packed[len(self.kept):]):
      at = 0
      for i, shape in group:
        size = math.prod(shape)
        leaves[i] = flat[at:at + size].reshape(shape)
        at += size
    return tuple(leaves)


# ---------------------------------------------------------------------------------------------
# The step


def make_train_step(graphdef, tx, schedule, loss_fn: Callable, sharding: TrainState, mesh,
                    dropout: bool = True, labels: Any = None,
                    packing: Packing | None = None) -> Callable:
  """Builds the jitted step on a state's flat leaves, `step(leaves, batch) -> (leaves, metrics)`
  (`leaves`: the tuple `jax.tree.leaves` gives of a state of `sharding`'s structure; with
  `packing`, that tuple packed, in and out: `Packing.pack`).

  Flat leaves, because JAX flattens a tuple of arrays in C++ and the state's `nnx.State`s in
  Python, several times slower for DensePhrases-MiniLM's hundreds of leaves
  (results/code_measurements.md). The input's flattening comes before the launch: an
  accelerator waits for it every step.
  `labels` ('train'/'frozen' per parameter, from `make_optimizer`) lets the step skip the
  gradients of frozen parameters (the optimizer ignores them anyway).
  """
  treedef = jax.tree.structure(sharding)

  def train_step(leaves: tuple, batch: dict):
    if packing is not None:
      leaves = packing.unpack(leaves)
    state = jax.tree.unflatten(treedef, leaves)
    rng = jax.random.fold_in(state.rng, state.step)

    def compute(params):
      if labels is not None:
        params = jax.tree.map(lambda p, l: jax.lax.stop_gradient(p) if l == "frozen" else p,
                              params, labels)
      model = nnx.merge(graphdef, params, state.rest)
      rngs = nnx.Rngs(dropout=rng) if dropout else None
      return loss_fn(model, batch, state.queue, state.step, rngs)

    (loss, (metrics, queue)), grads = jax.value_and_grad(compute, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state.step)}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              queue=queue)
    leaves = tuple(jax.tree.leaves(new_state))
    return (leaves if packing is None else packing.pack(leaves)), metrics

  out = tuple(jax.tree.leaves(sharding)) if packing is None else packing.shardings
  return jax.jit(train_step, donate_argnums=(0,), out_shardings=(out, NamedSharding(mesh, P())))


def init_state(model, tx, objective: Objective, *, seed: int, mesh):
  """(graphdef, state placed on the mesh, its sharding)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                     opt_state=tx.init(params), queue=objective.queue,
                     rng=jax.random.PRNGKey(seed))
  replicated = NamedSharding(mesh, P())
  sharding = TrainState(step=replicated, params=jax.tree.map(lambda _: replicated, params),
                        rest=jax.tree.map(lambda _: replicated, rest),
                        opt_state=jax.tree.map(lambda _: replicated, state.opt_state),
                        queue=objective.queue_sharding(mesh), rng=replicated)
  return graphdef, global_array(state, sharding), sharding


class Trainer:
  """A model's train state and its jitted step, ready to run (`build_trainer`).

  The state lives as the step's inputs between steps (`advance`: its flat leaves, packed by
  `packing`); `state` builds the `TrainState` from them when read (kept until the next step)
  and takes a new one when set. A step donates its input, so a `state` read before a step is
  invalid after it, as with any donated step."""

  def __init__(self, graphdef, state: TrainState, sharding: TrainState, flat_step: Callable,
               schedule: optax.Schedule, labels: Any, frozen: int, total: int,
               packing: Packing | None = None):
    self.graphdef, self.sharding, self.flat_step = graphdef, sharding, flat_step
    self.schedule, self.labels = schedule, labels
    self.frozen, self.total = frozen, total  # parameters not trained; all parameters
    self._treedef = jax.tree.structure(sharding)
    self.packing = packing
    if packing is not None:
      self._pack = jax.jit(packing.pack, out_shardings=packing.shardings)
      self._unpack = jax.jit(packing.unpack, out_shardings=tuple(jax.tree.leaves(sharding)))
    self.state = state

  @property
  def state(self) -> TrainState:
    if self._state is None:
      leaves = self._leaves if self.packing is None else self._unpack(self._leaves)
      self._state = jax.tree.unflatten(self._treedef, leaves)
    return self._state

  @state.setter
  def state(self, state: TrainState) -> None:
    leaves = self._flatten(state)
    self._leaves = leaves if self.packing is None else self._pack(leaves)
    self._state = state

  def _flatten(self, state: TrainState) -> tuple:
    leaves, treedef = jax.tree.flatten(state)
    if treedef != self._treedef:
      raise ValueError(f"a train state of another structure than the trainer's: {treedef} "
                       f"instead of {self._treedef}")
    return tuple(leaves)

  @property
  def leaves(self) -> tuple:
    """The step's inputs of the current state (its flat leaves, packed: what `advance` steps;
    no pytree built)."""
    return self._leaves

  def compile_ahead(self, batch: dict, widths: Sequence[int], keys: Sequence[str],
                    threads: int | None = None) -> int:
    """Compiles the step for batches shaped as the placed `batch` with its `keys` arrays cut to
    each of `widths` columns, every width at once in `threads` threads (XLA compiles outside
    the GIL): the steps on batches of those shapes then compile nothing. Returns the shapes."""
    return compile_at_once(lambda compile_one: compile_one(),
                           self.step_compiles(batch, widths, keys), threads)

  def step_compiles(self, batch: dict, widths: Sequence[int],
                    keys: Sequence[str]) -> list[Callable[[], None]]:
    """`compile_ahead`'s compiles, a function per width: to run at once with other compiles."""
    def spec(key: str, x) -> Callable[[int], jax.ShapeDtypeStruct]:
      return lambda width: jax.ShapeDtypeStruct(
          (x.shape[0], width, *x.shape[2:]) if key in keys else x.shape, x.dtype,
          sharding=x.sharding)
    specs = {key: spec(key, x) for key, x in batch.items()}

    def compile_width(width: int) -> None:
      self.flat_step.lower(self._leaves, {k: s(width) for k, s in specs.items()}).compile()

    return [functools.partial(compile_width, width) for width in widths]

  def advance(self, batch: dict) -> dict:
    """Runs the step on the current state (its flat leaves, no pytree built); its metrics."""
    self._leaves, metrics = self.flat_step(self._leaves, batch)
    self._state = None
    return metrics

  def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    """`(state, batch) -> (next state, metrics)`: the same step on a given state, which it
    donates (the trainer's own, if given, is then spent: set the result back)."""
    leaves = self._flatten(state)
    leaves, metrics = self.flat_step(leaves if self.packing is None else self._pack(leaves), batch)
    leaves = leaves if self.packing is None else self._unpack(leaves)
    return jax.tree.unflatten(self._treedef, leaves), metrics

  def model(self, state: TrainState | None = None):
    """The NNX model of the current (or a given) state's parameters."""
    state = self.state if state is None else state
    return nnx.merge(self.graphdef, state.params, state.rest)


def build_trainer(model, train_config, objective: Objective, *, mesh,
                  total_steps: int | None = None,
                  schedule: optax.Schedule | None = None,
                  packed: bool | None = None) -> Trainer:
  """The optimizer (`train.learning_rate`, `warmup_*` over `total_steps`, `grad_clip`,
  `weight_decay`, `freeze`; or `schedule`, another learning rate schedule, instead of
  `total_steps`), the train state on the mesh and the jitted step of `objective`, its
  optimizer state `packed` at the step's call (`Packing`; False: every leaf apart; None: on an
  accelerator only, where the step's host time is what packing saves, not on a CPU, where
  packing's copies cost the step more: results/code_measurements.md)."""
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tx, schedule, labels = make_optimizer(train_config, params, total_steps, schedule)
  frozen = sum(x.size for x, l in zip(jax.tree.leaves(params), jax.tree.leaves(labels))
               if l == "frozen")
  total = sum(x.size for x in jax.tree.leaves(params))
  graphdef, state, sharding = init_state(model, tx, objective, seed=train_config.seed, mesh=mesh)
  if packed is None:
    packed = mesh.devices.flat[0].platform != "cpu"
  packing = Packing(sharding, jax.tree.leaves(state), mesh) if packed else None
  step = make_train_step(graphdef, tx, schedule, objective.loss_fn, sharding, mesh,
                         train_config.dropout, labels, packing)
  return Trainer(graphdef, state, sharding, step, schedule, labels, frozen, total, packing)


# ---------------------------------------------------------------------------------------------
# Metrics


class MetricsWriter:
  """Appends JSON lines to a metrics file; on resume drops lines past the restored step.

  TensorBoard event files beside it (`workdir.tensorboard_run`) mirror the file: every numeric
  field of a record (`<split>/<name>`) is a scalar at the record's step. They are rewritten
  from the kept lines when the writer starts and when lines are dropped, so they hold exactly
  the file's records (no step a resume dropped), and flushed with every record, so a killed run
  keeps what it logged. A failed write of either raises. Without tensorboardX installed the
  writer warns once and writes no event files (removing stale ones all the same). Only the main
  process (process 0) writes; the others' writers do nothing.
  """

  def __init__(self, path: pathlib.Path, resume_step: int,
               tensorboard: pathlib.Path | None = None):
    self.path = path
    self.tensorboard = tensorboard_run(path) if tensorboard is None else tensorboard
    self.enabled = jax.process_index() == 0
    self._events = None  # the open event file (tensorboardX EventsWriter), once one is written
    self._warned = False  # whether the missing tensorboardX was logged
    if self.enabled:
      kept = [(line, record) for line, record in (self.read(path) if path.exists() else [])
              if record["step"] <= resume_step]
      if path.exists():
        write_text_atomic(path, "".join(line + "\n" for line, _ in kept))
      self._mirror([record for _, record in kept])

  @staticmethod
  def read(path: pathlib.Path) -> list[tuple[str, dict]]:
    """(line, record) of a metrics file; a torn last line (a run killed while writing it) is
    dropped, a bad line elsewhere is a DataError naming it."""
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
             if line.strip()]
    out = []
    for number, line in enumerate(lines, 1):
      try:
        record = json.loads(line)
        ok = isinstance(record, dict) and isinstance(record.get("step"), int)
      except json.JSONDecodeError:
        ok = False
      if ok:
        out.append((line, record))
      elif number < len(lines):
        raise DataError(f"{path}:{number}: not a metrics record: {line[:80]!r}")
      else:
        log.warning("%s: dropping a torn last line (%r)", path, line[:80])
    return out

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    self._add_event(record)
    if self._events is not None:
      self._events.flush()

  def drop(self, step: int, split: str) -> None:
    """Removes the records of `step` and `split` (one about to be written again)."""
    if not (self.enabled and self.path.exists()):
      return
    kept = [(line, record) for line, record in self.read(self.path)
            if (record["step"], record.get("split")) != (step, split)]
    write_text_atomic(self.path, "".join(line + "\n" for line, _ in kept))
    self._mirror([record for _, record in kept])

  def close(self) -> None:
    """Closes the event file (every record is already flushed)."""
    if self._events is not None:
      self._events.close()
      self._events = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _mirror(self, records: list[dict]) -> None:
    """Replaces the event files with one holding exactly `records`' scalars (their wall time is
    now: the metrics file records none)."""
    self.close()
    for stale in (self.tensorboard.glob("events.out.tfevents.*")
                  if self.tensorboard.is_dir() else []):
      stale.unlink()
    for record in records:
      self._add_event(record)
    if self._events is not None:
      self._events.flush()

  def _add_event(self, record: dict) -> None:
    """Appends a record's scalars as one event at its step (the file is opened on the first)."""
    if EventsWriter is None:
      if not self._warned:
        log.warning("tensorboardX is not installed: no TensorBoard event files in %s (%s holds "
                    "every record)", self.tensorboard, self.path.name)
        self._warned = True
      return
    values = [summary_pb2.Summary.Value(tag=tag, simple_value=value)
              for tag, value in scalars(record).items()]
    if not values:
      return
    if self._events is None:
      # The synchronous writer, not SummaryWriter: its queue thread would neither raise a
      # failed write nor write everything by a flush.
      self.tensorboard.mkdir(parents=True, exist_ok=True)
      # (a name of its own: the writer's names differ only by the second, and it truncates)
      self._events = EventsWriter(str(self.tensorboard / "events"), f".{time.time_ns()}")
    self._events.write_event(event_pb2.Event(wall_time=time.time(), step=record["step"],
                                             summary=summary_pb2.Summary(value=values)))


def scalars(record: dict) -> dict[str, float]:
  """The numeric fields of a metrics record as TensorBoard tags, `<split>/<name>` (a nested
  dict's names joined by `/`); the step, strings, booleans, None and lists are not scalars."""
  split, out = record.get("split"), {}

  def add(tag: str, value) -> None:
    if isinstance(value, dict):
      for key, inner in value.items():
        add(f"{tag}/{key}", inner)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
      out[tag] = float(value)

  for key, value in record.items():
    if key != "step":
      add(f"{split}/{key}" if isinstance(split, str) else key, value)
  return out


def every(step: int, n: int) -> bool:
  return n > 0 and step % n == 0


def check_finite(metrics: dict, step: int) -> dict:
  """Host values of a step's metrics; a DivergenceError for a non-finite or exploding loss or a
  non-finite gradient norm (checked on log steps and before every checkpoint)."""
  values = {k: float(v) for k, v in jax.device_get(metrics).items()}
  loss, norm = values["loss"], values.get("grad_norm", 0.0)
  if not (math.isfinite(loss) and math.isfinite(norm)) or abs(loss) > DIVERGED_LOSS:
    raise DivergenceError(f"training diverged at step {step}: loss {loss:.4g}, gradient norm "
                          f"{norm:.4g}; nothing was saved from this step on. Lower "
                          "train.learning_rate (or check the data) and resume or restart.")
  return values


# ---------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class Hook:
  """`fn(done, metrics)` after every step `done` (1-based) for which `due(done)` holds."""
  due: Callable[[int], bool]
  fn: Callable[[int, dict], None]


def run_steps(trainer: Trainer, steps: Iterable[int], batch: Callable[[int], dict],
              hooks: Sequence[Hook] = (), before: Callable | None = None) -> None:
  """The one training loop: for each step, `before(step, trainer)` (optional; it may set
  `trainer.state`), the jitted step on `batch(step)` (`trainer.advance`), then the hooks that
  are due, in order (log, evaluate, checkpoint...)."""
  for step in steps:
    if before is not None:
      before(step, trainer)
    metrics = trainer.advance(batch(step))
    for hook in hooks:
      if hook.due(step + 1):
        hook.fn(step + 1, metrics)


class Stopwatch:
  """Host seconds by part of a run, compiles apart: `with watch("data"): ...` adds the block's
  seconds to `seconds["data"]`, less the seconds JAX spent tracing, lowering and compiling in
  it (`compile_stats`), which go to `seconds["compiles"]`; a block `watch("compiles")` adds its
  wall time there (the compiles in it, some at once in threads, are not summed). A part inside
  another is taken off the outer one, so the parts add up to the outermost blocks' wall time.
  No device wait: what the device does between two host calls shows up in the part that waits
  for it."""

  def __init__(self):
    self.seconds: dict[str, float] = {}
    self._parts: list[str] = []  # the open blocks, innermost last
    stats = compile_stats()  # (JAX's compile events are listened to from here on)
    self._mark, self._count = (time.perf_counter(), stats["seconds"]), stats["count"]
    self._by_function = compiles_by_function()

  @property
  def compile_count(self) -> int:
    """XLA compilations (or loads from the compilation cache) since the stopwatch started."""
    return compile_stats()["count"] - self._count

  def slowest_compiles(self, n: int = 5) -> dict[str, dict]:
    """{function: {"compiles", "seconds"}} of the `n` functions whose XLA compiles since the
    stopwatch started took longest, slowest first."""
    since = {}
    for name, (count, seconds) in compiles_by_function().items():
      before = self._by_function.get(name, (0, 0.0))
      if count > before[0]:
        since[name] = {"compiles": count - before[0], "seconds": round(seconds - before[1], 3)}
    return dict(sorted(since.items(), key=lambda item: -item[1]["seconds"])[:n])

  def _close_interval(self) -> None:
    """Gives the seconds since the last mark to the innermost open part (compiles apart)."""
    now, compiled = time.perf_counter(), compile_stats()["seconds"]
    if self._parts:
      compiles = compiled - self._mark[1]
      part = self._parts[-1]
      self.seconds[part] = self.seconds.get(part, 0.0) + now - self._mark[0] - compiles
      self.seconds["compiles"] = self.seconds.get("compiles", 0.0) + compiles
    self._mark = (now, compiled)

  @contextlib.contextmanager
  def __call__(self, part: str):
    self._close_interval()
    self._parts.append(part)
    try:
      yield
    finally:
      self._close_interval()
      self._parts.pop()


class Preemption:
  """Whether to stop at a step boundary on SIGTERM (a scheduler's preemption notice, `kill`).

  One process: a signal handler notes the signal (a second SIGTERM kills at once, e.g. during a
  long evaluation); several: JAX's preemption sync point, where every process agrees on the same
  step (the distributed runtime catches the signal). `requested(step)` must be called once per
  step by every process. A context manager: the previous handler is restored on exit."""

  def __init__(self):
    self.signalled = False
    self._previous = None  # the handler before ours, while ours is installed

  def _handle(self, signum, frame):
    self.signalled = True
    signal.signal(signal.SIGTERM, self._previous)  # a second one kills as before
    log.warning("SIGTERM: stopping at the next step boundary with a checkpoint (again: now)")

  def requested(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signalled

  def __enter__(self):
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      previous = signal.signal(signal.SIGTERM, self._handle)
      self._previous = signal.SIG_DFL if previous is None else previous  # None: not from Python
    return self

  def __exit__(self, *exc):
    if self._previous is not None and not self.signalled:
      signal.signal(signal.SIGTERM, self._previous)
