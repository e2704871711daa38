"""Passage-grouped batches: several questions of one window per batch, the window encoded once."""
import json

import jax
import numpy as np
import pytest

from dpjax import losses
from dpjax.config import load_config
from dpjax.data import Tokenizer, data_files, load_rc_split
from dpjax.data.batches import GroupedBatches
from dpjax.models import create_model
from dpjax.objectives import make_objective
from dpjax.parallel import batch_sharding, make_mesh
from dpjax.settings import Settings
from dpjax.trainer import build_trainer

import run

RNG = np.random.default_rng(3)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
  config = load_config("experiments/demo.py:tiny")
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  workdir = tmp_path_factory.mktemp("grouped")
  return config, load_rc_split(data_files(config.data, workdir)["train"], tokenizer,
                               config.data).features


def test_every_answerable_feature_once_per_epoch(features):
  _, f = features
  usable = set(np.flatnonzero(f.start_position > 0).tolist())
  batches = GroupedBatches(f, windows_per_batch=3, group=2, seed=0)
  for epoch in (0, 1):
    seen, valid = [], 0
    groups = batches.groups(epoch)
    for index in range(batches.steps_per_epoch):
      batch = batches(epoch * batches.steps_per_epoch + index)
      assert batch["input_ids"].shape[0] == 3 and batch["question_input_ids"].shape[0] == 6
      for slot, window_groups in enumerate(groups[index * 3:(index + 1) * 3]):
        rows = window_groups.tolist()
        seen += rows
        # One window per group; each filled slot is one of its features, in order.
        assert len({int(f.window_index[r]) for r in rows}) == 1
        np.testing.assert_array_equal(batch["input_ids"][slot],
                                      f.windows.input_ids[f.window_index[rows[0]]])
        assert batch["question_valid"][slot * 2:slot * 2 + 2].tolist() == [
            i < len(rows) for i in range(2)]
        np.testing.assert_array_equal(batch["start_positions"][slot * 2:slot * 2 + len(rows)],
                                      f.start_position[rows])
      valid += int(batch["question_valid"].sum())
    assert sorted(seen) == sorted(usable) and valid == len(usable)
  # Epochs are shuffled differently, and the same way every time.
  assert [g.tolist() for g in batches.groups(0)] != [g.tolist() for g in batches.groups(1)]
  again = GroupedBatches(f, windows_per_batch=3, group=2, seed=0)
  assert [g.tolist() for g in again.groups(1)] == [g.tolist() for g in batches.groups(1)]


def test_last_batch_is_filled_with_empty_windows(features):
  _, f = features
  batches = GroupedBatches(f, windows_per_batch=5, group=3, seed=0)
  empty = batches.steps_per_epoch * 5 - batches.num_groups
  last = batches(batches.steps_per_epoch - 1)
  real = last["passage_ids"] >= 0
  assert int((~real).sum()) == empty
  assert not last["context_mask"][~real].any()  # no token of an empty window is a negative
  assert not last["question_valid"].reshape(5, 3)[~real].any()


def _reference(q, h, mask, gold, pids, windows, lw_inp, lw_inb):
  """Question n's softmax over its window's tokens (lambda_inp) and the tokens of windows of
  other passages (lambda_inb); other windows of its own passage are left out."""
  out = []
  for n in range(len(q)):
    logits, target = [], None
    for w in range(len(h)):
      if w != windows[n] and pids[w] == pids[windows[n]]:
        continue
      for t in np.flatnonzero(mask[w]):
        gold_token = w == windows[n] and t == gold[n]
        weight = 0.0 if gold_token else (lw_inp if w == windows[n] else lw_inb)
        if gold_token:
          target = len(logits)
        logits.append(float(q[n] @ h[w, t]) + weight)
    logits = np.array(logits, np.float64)
    out.append(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[target])
  return np.array(out)


def test_grouped_unified_loss_matches_numpy_and_skips_own_passage():
  w, length, dim = 4, 7, 5
  windows = np.array([0, 0, 0, 1, 2, 3, 3])  # window 1 is another window of window 0's passage
  pids = np.array([10, 10, 11, 12])
  q = RNG.normal(size=(len(windows), dim)).astype(np.float32)
  h = RNG.normal(size=(w, length, dim)).astype(np.float32)
  mask = RNG.random((w, length)) > 0.2
  gold = np.array([int(RNG.choice(np.flatnonzero(mask[k]))) for k in windows])
  kwargs = dict(log_weight_in_passage=0.0, log_weight_in_batch=float(np.log(4.0)))
  ours = losses.unified_loss(q, h, mask, gold, pids, query_windows=windows, **kwargs)
  np.testing.assert_allclose(ours, _reference(q, h, mask, gold, pids, windows, 0.0, np.log(4.0)),
                             rtol=1e-5)
  # No token of window 1 (same passage) is a negative of window 0's questions.
  moved = h.copy()
  moved[1] += 100.0
  again = losses.unified_loss(q, moved, mask, gold, pids, query_windows=windows, **kwargs)
  np.testing.assert_allclose(np.asarray(again)[:3], np.asarray(ours)[:3], rtol=1e-6)
  assert not np.allclose(np.asarray(again)[4:], np.asarray(ours)[4:])
  # One question per window: the same as the ungrouped loss.
  one = np.arange(w)
  np.testing.assert_allclose(
      losses.unified_loss(q[:w], h, mask, gold[:w], pids, query_windows=one, **kwargs),
      losses.unified_loss(q[:w], h, mask, gold[:w], pids, **kwargs), rtol=1e-6)


def _grouped_steps(config, batches, num_devices, steps=3):
  mesh = make_mesh(num_devices)
  s = Settings.of(config)
  model = create_model(s.model)
  objective = make_objective(s.train.loss, batch_size=4, length=s.data.max_seq_length,
                             dim=model.config.hidden_size)
  trainer = build_trainer(model, s.train, objective, total_steps=10, mesh=mesh)
  out = []
  for step in range(steps):
    trainer.state, metrics = trainer.step(trainer.state,
                                          jax.device_put(batches(step), batch_sharding(mesh)))
    out.append((float(metrics["loss"]), float(metrics["questions"])))
  return out, jax.device_get(trainer.state.params)


def test_grouped_step_four_devices_match_one(features):
  config, f = features
  config = config.copy_and_resolve_references()
  config.train.loss.prebatch_warmup_steps = 1  # step 3 uses the pre-batch queue
  batches = GroupedBatches(f, windows_per_batch=4, group=3, seed=0)
  one, params_1 = _grouped_steps(config, batches, 1)
  four, params_4 = _grouped_steps(config, batches, 4)
  assert all(np.isfinite(loss) and 4 <= n <= 12 for loss, n in one)
  np.testing.assert_allclose([x for x, _ in four], [x for x, _ in one], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               params_4, params_1)


def test_run_train_grouped_and_refusals(tmp_path):
  base = ["train", "--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path / "w")]
  assert run.main(base + ["--set", "train.questions_per_window=3"]) == 0
  records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text()
             .splitlines()]
  train = [r for r in records if r["split"] == "train"]
  assert train and all(np.isfinite(r["loss"]) and r["questions"] >= 1 for r in train)
  for r in train:  # questions/s: the windows' rate times the questions a step trains
    assert r["questions_per_sec"] == pytest.approx(r["examples_per_sec"] * r["questions"] / 8)
  assert run.main(["train", "--config", "experiments/demo.py:tiny", "--workdir",
                   str(tmp_path / "o"), "--set", "train.questions_per_window=3", "--set",
                   "train.loss.recipe=original"]) == 2
