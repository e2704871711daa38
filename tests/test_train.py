"""The jitted train step: data parallel == single device, both recipes; frozen parameters."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpjax.config import load_config
from dpjax.data import Tokenizer, data_files, load_rc_split
from dpjax.models import create_model
from dpjax.data.batches import TrainBatches
from dpjax.objectives import make_objective
from dpjax.parallel import batch_sharding, make_mesh
from dpjax.settings import Settings
from dpjax import training as train, trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  config = load_config("experiments/demo.py:tiny")
  workdir = tmp_path_factory.mktemp("tiny")
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  split = load_rc_split(data_files(config.data, workdir)["train"], tokenizer, config.data)
  return config, TrainBatches(split.features, config.train.batch_size, 0)


def _run_steps(config, batches, num_devices, steps=3):
  s = Settings.of(config)
  mesh = make_mesh(num_devices)
  model = create_model(s.model)
  objective = make_objective(s.train.loss, batch_size=s.train.batch_size,
                             length=s.data.max_seq_length, dim=model.config.hidden_size)
  built = trainer.build_trainer(model, s.train, objective, total_steps=10, mesh=mesh)
  state, step_fn = built.state, built.step
  losses = []
  for step in range(steps):
    state, metrics = step_fn(state, jax.device_put(batches(step), batch_sharding(mesh)))
    losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.params), state


@pytest.mark.parametrize("recipe", ["unified", "original"])
def test_eight_devices_match_one(tiny, recipe):
  config, batches = tiny
  config = config.copy_and_resolve_references()
  config.train.loss.recipe = recipe
  config.train.loss.prebatch_warmup_steps = 1  # step 3 uses the pre-batch queue
  assert jax.device_count() == 8
  losses_1, params_1, _ = _run_steps(config, batches, 1)
  losses_8, params_8, state_8 = _run_steps(config, batches, 8)
  np.testing.assert_allclose(losses_8, losses_1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               params_8, params_1)
  assert state_8.queue["vectors"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
  assert bool(state_8.queue["valid"].all())


def test_loop_on_flat_leaves_is_the_pytree_step(tiny):
  """`run_steps` steps the state's flat leaves (`Trainer.advance`); a `before` that sets
  `trainer.state` (the pre-batch queue emptied at step 2) takes effect; the losses and
  parameters equal those of `Trainer.step` on the state as a pytree, bit for bit (one
  executable). `state` is built once a step; a state of another structure is refused."""
  config, batches = tiny
  config = config.copy_and_resolve_references()
  config.train.loss.prebatch_warmup_steps = 1  # step 2 uses the queue: emptying it matters
  s = Settings.of(config)
  mesh = make_mesh(8)

  def build():
    model = create_model(s.model)
    objective = make_objective(s.train.loss, batch_size=s.train.batch_size,
                               length=s.data.max_seq_length, dim=model.config.hidden_size)
    return trainer.build_trainer(model, s.train, objective, total_steps=10, mesh=mesh)

  def emptied(state):
    return state.replace(queue={**state.queue, "valid": jax.numpy.zeros_like(
        state.queue["valid"])})

  def before(step, built):
    if step == 2:
      assert built.state is built.state  # built from the leaves once, then kept
      built.state = emptied(built.state)

  batch = lambda step: jax.device_put(batches(step), batch_sharding(mesh))
  loop, losses = build(), []
  trainer.run_steps(loop, range(3), batch,
                    [trainer.Hook(lambda d: True, lambda d, m: losses.append(float(m["loss"])))],
                    before=before)
  expected, params = {}, {}
  for empty in (True, False):
    reference = build()
    state, expected[empty] = reference.state, []
    for step in range(3):
      state = emptied(state) if step == 2 and empty else state
      state, metrics = reference.step(state, batch(step))
      expected[empty].append(float(metrics["loss"]))
    params[empty] = jax.device_get(state.params)
  assert losses == expected[True] and losses[2] != expected[False][2]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(loop.state.params), params[True])
  assert int(loop.state.step) == 3 and loop.state.queue["valid"].any()
  with pytest.raises(ValueError, match="another structure"):
    loop.state = loop.state.replace(queue={})


def test_the_optimizer_state_packed_at_the_steps_call_trains_the_same(tiny):
  """The step on the optimizer state packed into a buffer per dtype (`Packing`, an
  accelerator's default) takes a third of the arrays and trains as the step on every leaf
  apart, bit for bit; its state, read and set again (a checkpoint's round trip), is the same
  state, and a CPU mesh leaves it unpacked by default."""
  config, batches = tiny
  s = Settings.of(config)
  mesh = make_mesh(8)

  def build(packed):
    model = create_model(s.model)
    objective = make_objective(s.train.loss, batch_size=s.train.batch_size,
                               length=s.data.max_seq_length, dim=model.config.hidden_size)
    return trainer.build_trainer(model, s.train, objective, total_steps=10, mesh=mesh,
                                 packed=packed)

  batch = lambda step: jax.device_put(batches(step), batch_sharding(mesh))
  runs = {}
  for packed in (True, False):
    built, losses = build(packed), []
    trainer.run_steps(built, range(2), batch,
                      [trainer.Hook(lambda d: True, lambda d, m: losses.append(float(m["loss"])))])
    if packed:  # read and set back, as a checkpoint's save and restore do, then one more step
      built.state = jax.tree.map(jax.numpy.copy, built.state)
    trainer.run_steps(built, range(2, 3), batch,
                      [trainer.Hook(lambda d: True, lambda d, m: losses.append(float(m["loss"])))])
    runs[packed] = (built, losses, jax.device_get(built.state))
  (packed, losses, state), (plain, plain_losses, plain_state) = runs[True], runs[False]
  assert losses == plain_losses
  jax.tree.map(np.testing.assert_array_equal, state, plain_state)
  assert jax.tree.structure(state) == jax.tree.structure(plain_state)
  assert len(packed.leaves) < len(plain.leaves) / 2 and plain.packing is None
  assert len(jax.tree.leaves(packed.state)) == len(plain.leaves)
  assert build(None).packing is None  # a CPU mesh's default


def test_frozen_parameters_do_not_move(tiny):
  config, batches = tiny
  config = config.copy_and_resolve_references()
  config.train.freeze = ["word_embeddings", "query_end_encoder/layers/0/"]
  model = create_model(Settings.of(config).model)
  _, before, _ = nnx.split(model, nnx.Param, ...)
  before = jax.device_get(before)
  _, after, _ = _run_steps(config, batches, 8, steps=2)
  flat_before = dict(jax.tree_util.tree_leaves_with_path(before))
  moved = {trainer.param_path(p): not np.array_equal(flat_before[p], v)
           for p, v in jax.tree_util.tree_leaves_with_path(after)}
  frozen = [p for p in moved if "word_embeddings" in p or "query_end_encoder/layers/0/" in p]
  assert frozen and not any(moved[p] for p in frozen)
  assert moved["phrase_encoder/layers/1/output/kernel/value"]
  assert moved["query_end_encoder/layers/1/output/kernel/value"]


def test_schedule_warms_up_and_decays():
  schedule = trainer.learning_rate_schedule(1e-4, 10, 110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(10)) == pytest.approx(1e-4)
  assert float(schedule(60)) == pytest.approx(5e-5)
  assert float(schedule(110)) == pytest.approx(0.0, abs=1e-12)


def test_resume_conflicts_name_what_changed():
  import json
  stored = json.loads(load_config("experiments/squad.py:cpu").to_json())
  same = load_config("experiments/squad.py:cpu", ["train.progress_bar=False", "data.dir=/x",
                                                   "train.stop_at_step=10", "eval.limit=5"])
  assert train.resume_conflicts(stored, json.loads(same.to_json())) == []
  other = load_config("experiments/squad.py:cpu", ["train.loss.lambda_inb=256",
                                                    "train.learning_rate=2e-4"])
  assert train.resume_conflicts(stored, json.loads(other.to_json())) == [
      "train.learning_rate: 0.0001 -> 0.0002", "train.loss.lambda_inb: 1.0 -> 256.0"]
  # A checkpoint written before a setting existed was trained with its NEW_SETTINGS value.
  stored = json.loads(load_config("experiments/squad.py:cpu-base").to_json())
  same = load_config("experiments/squad.py:cpu-base")
  for key in train.NEW_SETTINGS:
    section, *path = key.split(".")
    node = stored[section]
    for name in path[:-1]:
      node = node[name]
    del node[path[-1]]
  assert train.resume_conflicts(stored, json.loads(same.to_json())) == []
  # A run records its sections (`RunSettings.to_json`) as the whole config recorded them before:
  # a checkpoint of either resumes with the other, and a changed setting is still named.
  for spec in ("experiments/squad.py:cpu", "experiments/demo.py:tiny"):
    whole = json.loads(load_config(spec).to_json())
    s = Settings.of(load_config(spec))
    record = json.loads(train.RunSettings(s.model, s.data, s.train, s.eval,
                                          s.validation).to_json())
    assert {name: whole[name] for name in record} == record
    assert train.resume_conflicts(whole, record) == [] == train.resume_conflicts(record, whole)
    other = dataclasses.replace(s.train, seed=s.train.seed + 1)
    record = json.loads(train.RunSettings(s.model, s.data, other, s.eval).to_json())
    assert train.resume_conflicts(whole, record) == [
        f"train.seed: {s.train.seed} -> {s.train.seed + 1}"]


def test_optimizer_settings(tiny):
  """Weight decay spares biases and LayerNorm scales (the reference's no_decay); a freeze
  pattern that matches nothing, a warm-up as long as the run and values no run can use are
  refused; grad_clip 0 clips nothing."""
  from dpjax.errors import ConfigError
  config, _ = tiny
  s = Settings.of(config)
  model = create_model(s.model)
  params = nnx.state(model, nnx.Param)
  tc = dataclasses.replace(s.train, weight_decay=0.1, warmup_steps=1)
  tx, _, _ = trainer.make_optimizer(tc, params, total_steps=10)
  state = tx.init(params)
  for _ in range(2):  # (step 0's learning rate is 0)
    updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  moved = {trainer.param_path(p): bool(np.abs(np.asarray(u)).max() > 0)
           for p, u in jax.tree_util.tree_leaves_with_path(updates)}
  assert moved["phrase_encoder/layers/0/output/kernel/value"]
  assert not moved["phrase_encoder/layers/0/output/bias/value"]
  assert not moved["phrase_encoder/layers/0/layer_norm/scale/value"]
  assert not moved["phrase_encoder/embeddings/word_embeddings/embedding/value"]  # frozen
  with pytest.raises(ConfigError, match="'embeddings.word_embeddings.weight' matches no"):
    trainer.param_labels(params, ["embeddings.word_embeddings.weight"])
  # Without decay the state is the one checkpoints written before the decay mask hold.
  tc = dataclasses.replace(tc, weight_decay=0.0)
  tx, schedule, _ = trainer.make_optimizer(tc, params, total_steps=10)
  before = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(
      optax.multi_transform({"train": before, "frozen": optax.set_to_zero()},
                            trainer.param_labels(params, tc.freeze)).init(params))
  tc = dataclasses.replace(tc, warmup_steps=10)
  with pytest.raises(ConfigError, match="warm-up of 10 steps leaves no decay"):
    trainer.make_optimizer(tc, params, total_steps=10)
  tc = dataclasses.replace(tc, warmup_steps=1, grad_clip=0.0, weight_decay=0.0)
  tx, _, _ = trainer.make_optimizer(tc, params, total_steps=10)
  big = jax.tree.map(lambda p: jnp.full_like(p, 1e3), params)
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update(big, state, params)
  assert max(float(np.abs(np.asarray(u)).max()) for u in jax.tree.leaves(updates)) > 0
  for setting in ("train.grad_clip=-1.0", "train.weight_decay=-0.5",
                  "train.warmup_fraction=1.5", "qsft.learning_rate=0.0"):
    with pytest.raises(ConfigError, match=setting.split("=")[0]):
      load_config("experiments/squad.py:cpu", [setting])


def test_questions_cut_per_step_change_no_loss(tiny):
  """trim_questions: every step's question arrays are cut to its longest question rounded up
  to 8 (the same width for any share of the step's rows), only padding is cut, and the training
  losses and parameters equal those of uncut batches (without dropout: its masks are drawn for
  the cut shape, so with it the runs differ by their random draws)."""
  from dpjax.data.batches import GroupedBatches
  config, batches = tiny
  features = batches.features
  cut = TrainBatches(features, config.train.batch_size, 0, question_multiple=8)
  full_width = features.question_input_ids.shape[1]
  widths = set()
  for step in range(4):
    whole, trimmed = batches(step), cut(step)
    width = trimmed["question_input_ids"].shape[1]
    widths.add(width)
    assert width % 8 == 0 or width == full_width
    longest = int(whole["question_attention_mask"].sum(1).max())
    assert longest <= width < longest + 8
    assert not whole["question_attention_mask"][:, width:].any()  # only padding was cut
    np.testing.assert_array_equal(trimmed["question_input_ids"],
                                  whole["question_input_ids"][:, :width])
    assert cut(step, slice(0, 1))["question_input_ids"].shape[1] == width  # a process's share
  assert min(widths) < full_width  # the test cuts something
  grouped = GroupedBatches(features, 4, 2, 0, question_multiple=8)
  share = grouped(0, slice(0, 1))
  assert share["question_input_ids"].shape[1] == grouped(0)["question_input_ids"].shape[1]
  config = config.copy_and_resolve_references()
  config.train.dropout = False
  # Losses of 3 steps (the later ones after updates from cut batches). Parameters are not
  # compared: a few have a true gradient of zero (the phrase encoder's last LayerNorm bias, as
  # the scores are shift-invariant), and Adam turns their rounding noise, which any change of
  # shapes alters, into steps the size of the learning rate.
  losses, _, _ = _run_steps(config, batches, 1, steps=3)
  losses_cut, _, _ = _run_steps(config, cut, 1, steps=3)
  np.testing.assert_allclose(losses_cut, losses, rtol=1e-5)


def test_flash_attention_kernel_trains_as_the_materialised_attention(tiny, monkeypatch):
  """`DPJAX_ATTENTION=pallas` (forced; Pallas' interpreter on this CPU) in the data-parallel
  train step over 8 devices: the phrase encoder's attention runs in the kernel, the question
  encoders' (widths the kernel does not take) as before, and two steps of training give the
  materialised path's losses and parameters (same dropout masks)."""
  from dpjax.models import bert, flash_attention
  config, batches = tiny
  config = config.copy_and_resolve_references()
  config.model.random.hidden_size, config.model.random.num_attention_heads = 64, 4  # heads of 16
  losses_ref, params_ref, _ = _run_steps(config, batches, 8, steps=2)
  calls = []
  kernel = flash_attention.flash_attention
  monkeypatch.setattr(flash_attention, "flash_attention",
                      lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
  monkeypatch.setattr(bert, "attention_implementation", lambda dtype: "pallas")
  losses, params, _ = _run_steps(config, batches, 8, steps=2)
  assert calls and all(shape[1] % 16 == 0 for shape in calls)
  np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
  # Adam moves a parameter ~lr (1e-4) a step; the phrase encoder's last LayerNorm bias, whose
  # gradient is 0 up to rounding (it shifts all of a passage's token scores alike, which the
  # softmax over tokens ignores), moves by that rounding's noise: ~1e-6, apart by up to 2.5e-6.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               params, params_ref)


def test_windows_without_answer_train_to_cls(tiny, tmp_path_factory):
  """train.loss.windows_without_answer: the features whose window lacks the answer join the
  batches with [CLS] as their target (a real loss and gradient); off, they are not drawn, and
  such a row would contribute nothing. [CLS] then also competes with every answer."""
  from dpjax.objectives import compute_loss
  config, _ = tiny
  config = config.copy_and_resolve_references()
  config.data.update(max_seq_length=48, doc_stride=16)  # short windows: some lack the answer
  workdir = tmp_path_factory.mktemp("short")
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  features = load_rc_split(data_files(config.data, workdir)["train"], tokenizer,
                           config.data).features
  batches = TrainBatches(features, config.train.batch_size, 0)
  without = np.flatnonzero(features.start_position == 0)
  assert len(without) >= config.train.batch_size  # the tiny data has such windows
  assert not np.isin(without, batches.usable).any()
  both = TrainBatches(features, config.train.batch_size, 0, without_answer=True)
  assert len(both.usable) == len(features.start_position)
  s = Settings.of(config)
  model = create_model(s.model)
  graph, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rows, on):
    loss_config = dataclasses.replace(s.train.loss, windows_without_answer=on, prebatch_size=0)
    both.usable, both.steps_per_epoch = rows, 1
    batch = {k: jax.numpy.asarray(v) for k, v in both(0).items()}
    value, _ = compute_loss(nnx.merge(graph, params, rest), batch, {}, 0, loss_config)
    return value

  rows = without[:config.train.batch_size]
  assert float(loss(params, rows, False)) == 0.0  # invalid targets: no signal
  value, grads = jax.value_and_grad(loss)(params, rows, True)
  assert float(value) > 0.0
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 0.0
  answerable = batches.usable[:config.train.batch_size]
  assert float(loss(params, answerable, True)) > float(loss(params, answerable, False))
  # Passage-grouped batches take them too: every feature is in one group of an epoch.
  from dpjax.data.batches import GroupedBatches
  grouped = GroupedBatches(features, 4, 2, 0, without_answer=True)
  rows = np.concatenate([grouped.rows(s) for s in range(grouped.steps_per_epoch)])
  assert set(without) <= set(rows.tolist())
  loss_config = dataclasses.replace(s.train.loss, windows_without_answer=True, prebatch_size=0)
  step = next(s for s in range(grouped.steps_per_epoch)
              if (grouped(s)["start_positions"][grouped(s)["question_valid"]] == 0).any())
  batch = {k: jax.numpy.asarray(v) for k, v in grouped(step).items()}
  value, _ = compute_loss(nnx.merge(graph, params, rest), batch, {}, 0, loss_config)
  assert np.isfinite(float(value)) and float(value) > 0.0
  # The empty windows that fill an epoch's last grouped batch (passage -1) add no candidate,
  # not even their [CLS]: whatever they hold, the loss is the same.
  filled = next((b for b in (grouped(s) for s in range(grouped.steps_per_epoch))
                 if (b["passage_ids"] < 0).any() and (b["passage_ids"] >= 0).any()), None)
  assert filled is not None  # 4 windows a batch leave some over in the tiny data
  filler = filled["passage_ids"] < 0
  other = dict(filled, input_ids=np.where(filler[:, None], 2000, filled["input_ids"]),
               attention_mask=np.where(filler[:, None], 1, filled["attention_mask"]))
  values = [float(compute_loss(nnx.merge(graph, params, rest),
                               {k: jax.numpy.asarray(v) for k, v in b.items()}, {}, 0,
                               loss_config)[0]) for b in (filled, other)]
  assert values[0] > 0.0 and values[1] == pytest.approx(values[0], rel=1e-6)


def test_the_step_and_the_rc_eval_compiled_ahead_compile_nothing_later(tmp_path, monkeypatch):
  """On an accelerator a training compiles its step for every question width its batches take,
  and its RC evaluation's encoders for every call that evaluation makes, before the first step
  and all at once (`compile_step_ahead`): the steps and the evaluation then load no executable
  of either, and the timing record counts the shapes and their wall time. (A model of its own
  size: a step and encoder calls no other test compiles.)"""
  config = load_config("experiments/demo.py:tiny", ["train.num_steps=5", "train.seed=3",
                                                    "train.learning_rate=3e-5",
                                                    "model.random.intermediate_size=43",
                                                    "eval.batch_size=7"])
  s = Settings.of(config)
  monkeypatch.setattr(train, "_compile_ahead", lambda mesh: True)
  loads = []  # the functions whose executables were compiled or read from the persistent cache
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, fun_name=None, **kwargs: loads.append(fun_name) if (
          event.endswith("backend_compile_duration")) else None)
  ahead, widths = [], []
  compile_step_ahead, step_compiles = train.compile_step_ahead, trainer.Trainer.step_compiles

  def counted(run, steps):
    shapes = compile_step_ahead(run, steps)
    ahead.append(len(loads))
    return shapes

  def step_widths(self, batch, step_widths, keys):
    widths.extend(step_widths)
    return step_compiles(self, batch, step_widths, keys)
  monkeypatch.setattr(train, "compile_step_ahead", counted)
  monkeypatch.setattr(trainer.Trainer, "step_compiles", step_widths)
  settings = train.RunSettings(s.model, s.data, s.train, s.eval)
  result = train.train_and_evaluate(settings, tmp_path)
  assert result["rc_exact_match"] >= 0 and len(ahead) == 1
  later = loads[ahead[0]:]  # during the steps and the evaluation
  assert "jit(train_step)" not in later and "jit(flat)" not in later, later
  run = train.setup(settings, tmp_path / "again")  # the same batches, for their widths
  taken = {run.to_device(step)["question_input_ids"].shape[1] for step in range(5)}
  assert widths == sorted(taken) and loads[:ahead[0]].count("jit(train_step)") == len(taken)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  timing = [r for r in records if r.get("split") == "timing"][-1]
  assert timing["compiled_ahead"] == len(taken) and timing["compiles_s"] > 0
  assert timing["rc_compiled_ahead"] == loads[:ahead[0]].count("jit(flat)") > 1
  assert timing["slowest_compiles"]["jit(train_step)"]["compiles"] == len(taken)
  assert timing["steps_s"] > 0 and timing["data_s"] > 0  # no part went negative
  monkeypatch.setattr(train, "_compile_ahead", lambda mesh: False)  # a CPU's way
  train.train_and_evaluate(settings, tmp_path / "plain")
  plain = [json.loads(line) for line in
           (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
  assert [r for r in plain if r.get("split") == "timing"][-1]["rc_compiled_ahead"] == 0
  assert [r["rc_exact_match"] for r in plain if r.get("split") == "dev"] == [
      r["rc_exact_match"] for r in records if r.get("split") == "dev"]


def test_a_compiles_block_counts_its_wall_time_not_the_sum_of_its_compiles():
  """`watch("compiles")` around compiles run at once in threads adds the block's wall time to
  "compiles" (their summed seconds could exceed it): no part goes negative, and the parts add up
  to at most the outer block's wall time."""
  import concurrent.futures
  import time
  watch = trainer.Stopwatch()
  start = time.perf_counter()
  with watch("steps"):
    with watch("compiles"):
      with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda n: jax.jit(lambda x: jnp.sin(x) * n).lower(jnp.ones(n)).compile(),
                      [13, 17]))
    jax.jit(lambda x: jnp.cos(x) - 5).lower(jnp.ones(19)).compile()  # a compile in "steps"
  total = time.perf_counter() - start
  assert watch.seconds["steps"] >= 0 and watch.seconds["compiles"] > 0
  assert sum(watch.seconds.values()) <= total
