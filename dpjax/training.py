"""A training run (`train_and_evaluate`, behind `run.py train` and `run.py teacher`): trains the
phrase and question encoders (or the teacher), evaluates RC EM/F1 on dev, validates on a
subcorpus, checkpoints; resumes exactly from the workdir.

The loop is `dpjax.trainer.run_steps`: one jitted step and hooks that fire by step (`every`):
progress, log, RC evaluation, subcorpus validation, checkpoint. A resumed run continues the same
data order and refuses a checkpoint trained with other settings.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils
from tqdm import tqdm

from dpjax.checkpoint import Checkpointer, abstract_like
from dpjax.errors import ConfigError, DataError, Preempted
from dpjax.data import Tokenizer, data_files, load_rc_split
from dpjax.data.batches import GroupedBatches, TrainBatches, question_widths
from dpjax.data.hard_negatives import HardNegatives, read_hard_negatives
from dpjax.data.teacher_logits import TeacherLogits
from dpjax.io import write_json
from dpjax.models import model_for_data
from dpjax.models.encoders import question_width_multiple
from dpjax.objectives import make_objective
from dpjax.parallel import (batch_sharding, compile_at_once, global_batch, local_rows, make_mesh,
                            round_to_devices)
from dpjax.reading import evaluate_rc, rc_compiles
from dpjax.io import digest, digest_texts, file_digest, workdir_lock
from dpjax.settings import (DataSettings, EvalSettings, ModelSettings, TrainSettings,
                            ValidationSettings, section_dict)
from dpjax.workdir import Workdir
from dpjax.trainer import (Hook, MetricsWriter, Preemption, Stopwatch, Trainer, build_trainer,
                           check_finite, every, run_steps)
from dpjax.validation import Validator

log = logging.getLogger(__name__)

# Settings a resumed run may change: they do not alter the training trajectory.
RESUME_FREE = ("train.stop_at_step", "train.log_every", "train.checkpoint_every",
               "train.keep_checkpoints", "train.progress_bar", "data.dir", "model.name",
               "model.tokenizer", "model.init")
# Settings added after checkpoints were written, with the value that trains as before: a
# checkpoint without one was trained with that value.
NEW_SETTINGS = {"train.questions_per_window": 1, "train.teacher_logits": "",
                "train.loss.lambda_distill": 2.0, "train.loss.score_scale": 1.0,
                "train.loss.windows_without_answer": False}


def resume_conflicts(stored: dict, config: dict) -> list[str]:
  """The `model`, `data` and `train` settings of `config` that differ from those a checkpoint
  was trained with (`stored`), as 'key: stored -> now', except the `RESUME_FREE` ones."""
  def settings(tree: dict) -> dict:
    flat = traverse_util.flatten_dict(
        {s: tree.get(s, {}) for s in ("model", "data", "train")}, sep=".")
    return {k: v for k, v in flat.items() if k not in RESUME_FREE}

  old, new = {**NEW_SETTINGS, **settings(stored)}, settings(config)
  return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
          for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The config sections a training run reads, built by its program (`run.py train`, `run.py
  teacher`): the model, its data and training, RC evaluation on dev, and the phrase model's
  subcorpus validation (None: none)."""
  model: ModelSettings
  data: DataSettings
  train: TrainSettings
  evaluation: EvalSettings
  validation: ValidationSettings | None = None

  def to_json(self) -> str:
    """The sections as a checkpoint's meta records them ("config"), named as in the experiment
    config; a resume compares their model, data and train (`resume_conflicts`)."""
    sections = {"model": self.model, "data": self.data, "train": self.train,
                "eval": self.evaluation, "validation": self.validation}
    return json.dumps({name: section_dict(section) for name, section in sections.items()
                       if section is not None})


@dataclasses.dataclass
class Run:
  """One training run: its data, trainer, checkpoints and progress."""
  settings: RunSettings
  workdir: Workdir  # the run's own: the workdir, or the teacher's inside it
  trainer: Trainer
  batches: TrainBatches
  dev: Any  # the dev RCSplit
  mesh: Any
  total: int  # steps of the schedule
  first: int  # the step the run starts (resumes) at
  checkpointer: Checkpointer
  writer: MetricsWriter
  to_device: Callable[[int], dict]  # step -> this process's rows of the global batch, on device
  data: str = ""  # fingerprint of the training features (checkpoint meta; resume checks it)
  inputs: dict = dataclasses.field(default_factory=dict)  # `_inputs` (checkpoint meta, too)
  record: dict = dataclasses.field(default_factory=dict)  # the last RC evaluation
  clock: list = dataclasses.field(default_factory=list)  # [time, step] of the last log
  window: list = dataclasses.field(default_factory=lambda: [None, 0])  # [sums, steps] to log
  progress: Any = None  # the tqdm bar
  # Where the process's seconds went (`_timing_record`), and the sequences its steps encoded.
  watch: Stopwatch = dataclasses.field(default_factory=Stopwatch)
  encoded: dict = dataclasses.field(default_factory=dict)
  compiled_ahead: int = 0  # the step's shapes compiled before the loop (`compile_step_ahead`)
  rc_compiled_ahead: int = 0  # the RC evaluation's encoder call shapes compiled with them


def features_fingerprint(features) -> str:
  """The training data a run (and the teacher's logits) is tied to."""
  f = features
  return digest(f.windows.input_ids, f.question_input_ids, f.window_index, f.question_index,
                f.start_position, f.end_position)


def setup(settings: RunSettings, workdir: pathlib.Path, spec: "Spec | None" = None) -> Run:
  """Reads the data, builds the trainer and restores the latest checkpoint of `spec`'s outputs
  (`workdir/spec.subdir`)."""
  tc, spec = settings.train, spec or PHRASE
  mesh = make_mesh()
  if tc.batch_size % mesh.size:
    raise ConfigError(f"train.batch_size {tc.batch_size} must be a multiple of the "
                     f"{mesh.size} devices")
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  files = data_files(settings.data, workdir)
  train = load_rc_split(files["train"], tokenizer, settings.data)
  dev = load_rc_split(files["dev"], tokenizer, settings.data,
                      limit=settings.evaluation.limit or None)
  data = features_fingerprint(train.features)
  batches = spec.batches(settings.data, tc, train, workdir, data)
  total = tc.num_steps or tc.epochs * batches.steps_per_epoch
  model = spec.model(settings.model, settings.data)
  trainer = build_trainer(model, tc, spec.objective(settings.data, tc, model), total_steps=total,
                          mesh=mesh)
  log.info("%s: %d steps (%d per epoch, batch %d on %d devices, %d processes); %d of %d "
           "parameters frozen", spec.name, total, batches.steps_per_epoch, tc.batch_size,
           mesh.size, jax.process_count(), trainer.frozen, trainer.total)
  del model
  out = Workdir(workdir, spec.subdir)
  checkpointer = Checkpointer(out.checkpoints(), keep=tc.keep_checkpoints)
  inputs = _inputs(tc, batches)
  meta = _restore(trainer, checkpointer, settings, out, data, inputs)
  first = int(trainer.state.step)
  # Each process builds and transfers only its own rows of every global batch.
  mine = local_rows(batch_sharding(mesh), tc.batch_size)
  to_device = lambda step: global_batch(batches(step, mine), batch_sharding(mesh), tc.batch_size,
                                       mine.stop - mine.start)
  return Run(settings, out, trainer, batches, dev, mesh, total, first, checkpointer,
             MetricsWriter(out.metrics, first), to_device, data, inputs,
             window=_restored_window(meta))


def _batches(data: DataSettings, train: TrainSettings, split, workdir: pathlib.Path,
             fingerprint: str) -> TrainBatches | GroupedBatches:
  """The batch source of the training RCSplit `split`: one question per example, or
  passage-grouped (`questions_per_window`); with the teacher's logits when `train.teacher_logits`
  is set (those of the features `fingerprint`)."""
  teacher = None
  if train.teacher_logits:
    teacher = TeacherLogits(workdir / train.teacher_logits, data=fingerprint,
                            length=data.max_seq_length)
  # Question arrays cut per step to its longest question (fewer padding tokens encoded).
  multiple = question_width_multiple(jax.devices()[0].platform)
  without_answer = train.loss.windows_without_answer
  if train.questions_per_window <= 1:
    batches = TrainBatches(split.features, train.batch_size, train.seed,
                           _hard_negatives(train, split), teacher, question_multiple=multiple,
                           without_answer=without_answer)
  else:
    unsupported = {"train.loss.recipe (unified only)": train.loss.recipe != "unified",
                   "train.hard_negatives.file": bool(train.hard_negatives.file),
                   "train.loss.weight_filter": bool(train.loss.weight_filter)}
    if any(unsupported.values()):
      raise ConfigError("train.questions_per_window > 1 (passage-grouped batches) does not go "
                        "with " + ", ".join(k for k, v in unsupported.items() if v))
    batches = GroupedBatches(split.features, train.batch_size, train.questions_per_window,
                             train.seed, teacher, question_multiple=multiple,
                             without_answer=without_answer)
  if teacher is not None:
    total = train.num_steps or train.epochs * batches.steps_per_epoch
    missing = teacher.missing(np.concatenate([batches.rows(s) for s in range(total)]))
    if missing:
      raise DataError(f"{teacher.directory}: no teacher logits for {missing} examples of this "
                      "run's steps; run `run.py teacher` with this run's train settings")
  return batches


def _phrase_objective(data: DataSettings, train: TrainSettings, phrase_model):
  """The phrase model's objective: `train.loss`'s recipe over its batches' windows."""
  return make_objective(train.loss, batch_size=train.batch_size, length=data.max_seq_length,
                        dim=phrase_model.config.hidden_size)


@dataclasses.dataclass(frozen=True)
class Spec:
  """What `train_and_evaluate` trains: the phrase model (PHRASE) or the cross-encoder teacher
  (`dpjax.teacher.TEACHER`), with the same step, checkpoints, resume, hooks and RC evaluation."""
  name: str
  subdir: str  # checkpoints, metrics.jsonl, results.json, rc_predictions.json go here
  model: Callable  # (model: ModelSettings, data: DataSettings) -> the model to train
  objective: Callable  # (data, train: TrainSettings, the model) -> Objective
  batches: Callable  # (data, train, the train RCSplit, workdir, its fingerprint) -> batch source


PHRASE = Spec("phrase model", "", model_for_data, _phrase_objective, _batches)


def _hard_negatives(train: TrainSettings, split) -> HardNegatives | None:
  """The mined negatives of the training RCSplit `split` (`train.hard_negatives.file`), if any."""
  if not train.hard_negatives.file:
    return None
  hard = HardNegatives(read_hard_negatives(train.hard_negatives.file, split.questions,
                                           len(split.passages)),
                       split.features.windows, split.questions,
                       [p.text for p in split.passages], train.hard_negatives.per_example,
                       train.seed)
  if train.loss.recipe != "unified":
    raise ConfigError("hard negatives are a term of the unified loss (train.loss.recipe=unified)")
  return hard


def random_with_answer(batches) -> dict:
  """`{"hard_negatives_random_with_answer": n}`: the random hard negatives that `batches` (a
  batch source; {} without hard negatives) drew for this process's steps with their question's
  answer, none without it found (`HardNegatives.random_with_answer`), summed over the
  processes (each draws for its own rows), warned when not 0. Every process must call it."""
  hard = getattr(batches, "hard_negatives", None)
  if hard is None:
    return {}
  count = hard.random_with_answer
  if jax.process_count() > 1:
    count = multihost_utils.process_allgather(np.int64(count)).sum()
  count = int(count)
  if count:
    log.warning("%d random hard negatives of these steps hold their question's answer: no "
                "other passage without it was found in %d draws", count,
                HardNegatives.RANDOM_DRAWS)
  return {"hard_negatives_random_with_answer": count}


def _inputs(train: TrainSettings, batches) -> dict:
  """Fingerprints of what a run reads besides its features and settings: the teacher's logits
  and the hard-negatives file (the same paths may hold other contents by a resume)."""
  inputs = {}
  if getattr(batches, "teacher", None) is not None:
    inputs["teacher_logits"] = digest_texts(json.dumps(batches.teacher.fingerprint,
                                                       sort_keys=True))
  if getattr(batches, "hard_negatives", None) is not None:
    inputs["hard_negatives"] = file_digest(train.hard_negatives.file)
  return inputs


def _restore(trainer: Trainer, checkpointer: Checkpointer, settings: RunSettings,
             workdir: Workdir, data: str, inputs: dict) -> dict:
  """Resumes from the latest checkpoint, refusing one trained with other settings, data or
  inputs (`_inputs`); returns its meta ({} for a fresh run)."""
  restored = checkpointer.restore(abstract_like(trainer.state))
  if not restored:
    return {}
  trainer.state, meta = restored
  if "config" in meta:  # a resumed run must continue the same training, not another one
    conflicts = resume_conflicts(json.loads(meta["config"]), json.loads(settings.to_json()))
    if conflicts:
      raise ConfigError(
          f"{workdir.checkpoints()} holds a run trained with other settings; resuming it "
          f"with these would silently mix two runs ({'; '.join(conflicts)}). Train into a "
          "new --workdir, or resume with the checkpoint's settings.")
  if meta.get("data", data) != data:  # (checkpoints before fingerprints: not checked)
    raise ConfigError(
        f"{workdir.checkpoints()} holds a run trained on other data than the configured data "
        f"(data.dir {settings.data.dir or '-'!r}) gives now: the training features differ; "
        "train into a new --workdir.")
  changed = sorted(k for k in set(meta.get("inputs", inputs)) | set(inputs)
                   if meta.get("inputs", inputs).get(k) != inputs.get(k))
  if changed:  # (checkpoints before inputs were recorded: not checked)
    raise ConfigError(
        f"{workdir.checkpoints()} holds a run trained with other {' and '.join(changed)} than "
        "the configured files hold now (rewritten since); resuming would mix the two: train "
        "into a new --workdir.")
  return meta


def evaluate(run: Run, step: int) -> dict:
  """RC EM/F1 on the dev split with the current parameters (metrics.jsonl, rc_predictions)."""
  evaluation = run.settings.evaluation
  scores, predictions = evaluate_rc(
      run.trainer.model(), run.dev.features, run.dev.passages, run.dev.questions,
      mesh=run.mesh, batch_size=round_to_devices(evaluation.batch_size, run.mesh),
      max_answer_length=evaluation.max_answer_length)
  record = {"step": step, "split": "dev", "rc_exact_match": scores["exact_match"],
            "rc_f1": scores["f1"], "count": scores["count"]}
  run.writer.write(record)
  if jax.process_index() == 0:
    write_json(run.workdir.report("rc_predictions.json"), predictions)
  log.info("step %d: dev RC EM %.2f F1 %.2f (%d questions)", step, scores["exact_match"],
           scores["f1"], scores["count"])
  run.record = record
  return record


def _finished(run: Run) -> dict:
  """A finished run's results.json when it was evaluated at the last step, so running the
  command again does not repeat the evaluation (single process: with several, every process
  must take the same branch of a collective evaluation, and only process 0 writes the file)."""
  path = run.workdir.results
  if jax.process_count() > 1 or not path.is_file():
    return {}
  try:
    old = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError):
    return {}
  if not isinstance(old, dict) or old.get("step") != run.first or "rc_exact_match" not in old:
    return {}
  log.info("step %d: finished and evaluated before (%s): dev RC EM %.2f", run.first, path,
           old["rc_exact_match"])
  return old


def _meta(run: Run, done: int) -> dict:
  epoch, index = run.batches.position(done)
  return {"step": done, "epoch": epoch, "index_in_epoch": index,
          "config": run.settings.to_json(), "data": run.data, "inputs": run.inputs,
          "log_window": _window_record(run)}


def _window_record(run: Run) -> dict:
  """The metrics summed since the last log (`run.window`), for a resume to log them as an
  uninterrupted run would: {"steps": n, "sums": {name: [value, dtype]}} (exact: float32 and
  int values survive JSON)."""
  total, steps = run.window
  sums = {k: [np.asarray(v).item(), str(np.asarray(v).dtype)]
          for k, v in (jax.device_get(total) if total is not None else {}).items()}
  return {"steps": steps, "sums": sums}


def _restored_window(meta: dict) -> list:
  """`run.window` as a checkpoint's meta recorded it (none before these were recorded)."""
  record = meta.get("log_window") or {}
  if not record.get("steps"):
    return [None, 0]
  return [{k: jnp.asarray(v, dtype) for k, (v, dtype) in record["sums"].items()},
          record["steps"]]


_add_metrics = jax.jit(lambda total, metrics: jax.tree.map(jnp.add, total, metrics))


def _accumulate(run: Run, done: int, metrics: dict) -> None:
  """Adds a step's metrics to the sums since the last log, on the device (no host wait)."""
  total, steps = run.window
  run.window[:] = [metrics if total is None else _add_metrics(total, metrics), steps + 1]


def _log(run: Run, done: int, metrics: dict) -> None:
  """Logs the mean of each metric over the steps since the last log (`steps_averaged`; a
  non-finite value in any of them fails the check) and the last step's learning rate."""
  total, steps = run.window
  run.window[:] = [None, 0]
  values = check_finite({k: v / steps for k, v in total.items()}, done)
  if "learning_rate" in metrics:
    values["learning_rate"] = float(jax.device_get(metrics["learning_rate"]))
  values["steps_averaged"] = steps
  now = time.perf_counter()
  steps_per_sec = (done - run.clock[1]) / (now - run.clock[0])
  values["examples_per_sec"] = steps_per_sec * run.settings.train.batch_size  # windows, if grouped
  if "questions" in values:  # passage-grouped batches: the questions a step trains vary
    values["questions_per_sec"] = steps_per_sec * values["questions"]
  run.clock[:] = [now, done]
  run.writer.write({"step": done, "split": "train", "epoch": run.batches.position(done - 1)[0],
                    **values})
  run.progress.set_postfix(loss=f"{values['loss']:.3f}",
                           ex_s=f"{values['examples_per_sec']:.1f}")


def _checkpoint(run: Run, done: int, metrics: dict) -> None:
  check_finite(metrics, done)  # a diverged state is never saved
  run.checkpointer.save(done, run.trainer.state, _meta(run, done))
  run.clock[0] = time.perf_counter()  # saving time is not training throughput


def _validate(run: Run, validator: Validator, done: int, metrics: dict) -> None:
  check_finite(metrics, done)  # the validator saves into checkpoints_best
  validator(done, run.trainer.model(), run.trainer.state, _meta(run, done))


def _preempted(run: Run, done: int, metrics: dict) -> None:
  if run.checkpointer.latest_step() != done:
    _checkpoint(run, done, metrics)
  raise Preempted(f"{run.workdir}: training stopped on SIGTERM at step {done} of {run.total}, "
                  f"checkpoint {done} saved; the same command resumes from it")


def make_hooks(run: Run, stop: int, validator: Validator | None,
               preemption: Preemption | None = None) -> list[Hook]:
  """progress, log, RC evaluation, validation, checkpoint, and a stop on SIGTERM (with a
  checkpoint of that step): in this order after a step."""
  tc, evaluation = run.settings.train, run.settings.evaluation
  hooks = [Hook(lambda d: True, lambda d, m: run.progress.update(1)),
           Hook(lambda d: True, functools.partial(_accumulate, run)),
           Hook(lambda d: every(d, tc.log_every) or d == stop,
                functools.partial(_log, run)),
           Hook(lambda d: every(d, evaluation.every_steps) or d == run.total,
                _timed(run, "rc_eval", lambda d, m: evaluate(run, d)))]
  if validator:
    hooks.append(Hook(lambda d: every(d, validator.every_steps) or d == run.total,
                      _timed(run, "validation", functools.partial(_validate, run, validator))))
  hooks.append(Hook(lambda d: every(d, tc.checkpoint_every) or d == stop,
                    _timed(run, "checkpoint", functools.partial(_checkpoint, run))))
  if preemption is not None:
    # Called every step (the processes' sync protocol); the last step finishes the run anyway.
    hooks.append(Hook(lambda d: preemption.requested(d) and d < stop,
                      functools.partial(_preempted, run)))
  return hooks


def _timed(run: Run, part: str, fn: Callable[[int, dict], None]) -> Callable[[int, dict], None]:
  """A hook `fn` timed as `part` of the run (`run.watch`), from when the step it follows has
  finished: these hooks wait for the device anyway, and the step's time stays the steps'."""
  def timed(done: int, metrics: dict) -> None:
    jax.block_until_ready(metrics)
    with run.watch(part):
      fn(done, metrics)
  return timed


def _timed_batches(run: Run) -> Callable[[int], dict]:
  """`run.to_device` timed as the run's "data" part, counting the sequences each step encodes
  (rows and tokens of its windows and of its questions, padding included)."""
  def batch(step: int) -> dict:
    with run.watch("data"):
      placed = run.to_device(step)
    for key, rows_name, tokens_name in (("input_ids", "windows", "window_tokens"),
                                        ("question_input_ids", "questions", "question_tokens")):
      if key in placed:
        rows, width = placed[key].shape[:2]
        run.encoded[rows_name] = run.encoded.get(rows_name, 0) + rows
        run.encoded[tokens_name] = run.encoded.get(tokens_name, 0) + rows * width
    return placed
  return batch


def _timing_record(run: Run, step: int) -> dict:
  """metrics.jsonl's "timing" record of this process: host seconds by part (`Stopwatch`).

  setup_s: reading the data, building the model and trainer, restoring, the validator;
  data_s: making each step's batch and putting it on the devices (the device may be running
  earlier steps meanwhile); steps_s: the rest of the loop, dispatching steps and waiting for
  them (on log steps, before evaluations and checkpoints); rc_eval_s, validation_s,
  checkpoint_s: those hooks after their step finished; compiles_s: JAX's tracing, lowering and
  compiling in all of these (taken off each), and the wall time of compiling the step ahead
  (`compiled_ahead`: its shapes; `rc_compiled_ahead`: the RC evaluation's encoder call shapes
  compiled with them; `slowest_compiles`: the functions whose compiles took longest).
  Their sum is below the process's wall time (its start, imports and exit are not in it)."""
  seconds = {f"{k}_s": round(v, 3) for k, v in sorted(run.watch.seconds.items())}
  return {"step": step, "split": "timing", "steps_run": max(step - run.first, 0), **seconds,
          "compiles": run.watch.compile_count, "compiled_ahead": run.compiled_ahead,
          "rc_compiled_ahead": run.rc_compiled_ahead,
          "slowest_compiles": run.watch.slowest_compiles(),
          "encoded": dict(run.encoded)}


# On an accelerator the step is compiled for every question width its batches will take before
# the first step, and the RC evaluation's encoders for every call it will make, all at once
# (`compile_at_once`), sooner than one after the other as they come (each a long compile there:
# results/gpu_check.md). A CPU compiles them as they come: its cores run the compiles and the
# steps alike.
def _compile_ahead(mesh) -> bool:
  return mesh.devices.flat[0].platform != "cpu"


QUESTION_KEYS = ("question_input_ids", "question_attention_mask")


def compile_step_ahead(run: Run, steps: range) -> int:
  """When `_compile_ahead`: compiles the step for each question width of the batches of `steps`
  (`question_widths`; when the batches cut their questions per step) and, when one of `steps`
  evaluates, the RC evaluation's encoder calls (`rc_compiles`; counted in `rc_compiled_ahead`),
  all at once. Returns the step's shapes compiled."""
  if not (steps and _compile_ahead(run.mesh)):
    return 0
  compiles = []
  if getattr(run.batches, "question_multiple", 0):
    compiles = run.trainer.step_compiles(run.to_device(steps[0]),
                                         question_widths(run.batches, steps), QUESTION_KEYS)
  evaluation = run.settings.evaluation
  rc = []
  if any(every(d, evaluation.every_steps) or d == run.total for d in range(steps[0] + 1,
                                                                            steps[-1] + 2)):
    rc = rc_compiles(run.trainer.model(), run.dev.features, mesh=run.mesh,
                     batch_size=round_to_devices(evaluation.batch_size, run.mesh))
  compile_at_once(lambda compile_one: compile_one(), compiles + rc)
  run.rc_compiled_ahead = len(rc)
  return len(compiles)


def _new_epoch_queue(run: Run, step: int, trainer: Trainer) -> None:
  """A new epoch revisits the same passages: the pre-batch queue starts afresh."""
  if not (run.batches.position(step)[1] == 0 and step > 0
          and run.settings.train.loss.clear_prebatch_each_epoch):
    return
  state = trainer.state  # built from the step's leaves only here, at an epoch's start
  if state.queue:
    trainer.state = state.replace(queue={**state.queue,
                                         "valid": jnp.zeros_like(state.queue["valid"])})


def train_and_evaluate(settings: RunSettings, workdir: str | pathlib.Path,
                       spec: Spec = PHRASE) -> dict:
  """`run.py train`: trains, evaluates RC EM/F1 on dev, checkpoints; resumes from `workdir`
  (one training run per workdir at a time: `<workdir>/train.lock`)."""
  validation = settings.validation if spec is PHRASE else None
  if validation and validation.corpus:
    Validator.check(validation)
  workdir, run_dir = Workdir(workdir), Workdir(workdir, spec.subdir)
  run_dir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() != 0:
    return _train(settings, workdir, spec, validation)
  with workdir_lock(run_dir.run_lock("train"), "training"):
    return _train(settings, workdir, spec, validation)


def _train(settings: RunSettings, workdir: pathlib.Path, spec: Spec,
           validation: ValidationSettings | None) -> dict:
  """The run of `train_and_evaluate`, with subcorpus validation when `validation` sets a corpus
  and `every_steps`; its results record."""
  main = jax.process_index() == 0
  watch = Stopwatch()
  with watch("setup"):
    run = setup(settings, workdir, spec)
    eval_batch = round_to_devices(settings.evaluation.batch_size, run.mesh)
    validator = (Validator(validation, settings.data, settings.evaluation, workdir,
                           data_files(settings.data, workdir)["dev"],
                           Tokenizer.from_pretrained(settings.model.tokenizer), run.mesh,
                           eval_batch, run.writer)
                 if validation and validation.corpus and validation.every_steps else None)
  run.watch = watch
  stop = min(run.total, settings.train.stop_at_step or run.total)
  run.progress = tqdm(total=run.total, initial=run.first, desc="train", dynamic_ncols=True,
                      disable=not (settings.train.progress_bar and main))
  run.clock = [time.perf_counter(), run.first]
  try:
    with watch("compiles"):
      run.compiled_ahead = compile_step_ahead(run, range(run.first, stop))
    with Preemption() as preemption, watch("steps"):
      run_steps(run.trainer, range(run.first, stop), _timed_batches(run),
                make_hooks(run, stop, validator, preemption),
                before=functools.partial(_new_epoch_queue, run))
  finally:
    run.progress.close()
    run.checkpointer.close()
    run.writer.close()  # (an error or a stop leaves no event file open; later writes reopen it)
  record = run.record
  if stop > run.first:  # steps run now: how their hard negatives were drawn
    drawn = random_with_answer(run.batches)
    record = {**record, **drawn} if record else record
  if run.first >= run.total and not record:
    record = _finished(run)
    if not record:  # (killed after the last checkpoint: its evaluation's record is replaced)
      run.writer.drop(run.first, "dev")
      with watch("rc_eval"):
        record = evaluate(run, run.first)
  if validator:
    record = {**record, **validator.best()}
    validator.close()
  if stop > run.first:  # a rerun of a finished training adds no timing line
    timing = _timing_record(run, stop)
    run.writer.write(timing)
    log.info("timing: %s", {k: v for k, v in timing.items() if k.endswith("_s")})
  run.writer.close()
  if record and main:
    write_json(run.workdir.results, record)
  return record
