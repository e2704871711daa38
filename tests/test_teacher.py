"""The cross-encoder teacher: its inputs and head, its logits file, distillation in training."""
import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpjax.config import load_config
from dpjax.data.batches import GroupedBatches, TrainBatches, cross_batch, cross_encoder_inputs
from dpjax.data.squad import RCFeatures
from dpjax.data.windows import PassageWindows
from dpjax.data.teacher_logits import TeacherLogits, write_teacher_logits
from dpjax.errors import DataError
from dpjax.models.bert import BertConfig
from dpjax.models.reader import CrossEncoderReader
from dpjax.objectives import compute_loss, teacher_loss
from dpjax.parallel import make_mesh
from dpjax.reading import reader_logits
from dpjax.settings import Settings

import run

CONFIG = "experiments/demo.py:tiny"
TINY = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)


def random_rows(rng, b, length, lengths):
  ids = rng.integers(5, 60, (b, length))
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask > 0, ids, 0)
  ids[:, 0] = 1  # [CLS]
  ids[np.arange(b), lengths - 1] = 2  # [SEP]
  return ids, mask


def test_cross_inputs_put_every_window_token_where_align_says():
  rng = np.random.default_rng(0)
  w_ids, w_mask = random_rows(rng, 6, 20, rng.integers(4, 21, 6))
  q_ids, q_mask = random_rows(rng, 6, 9, rng.integers(3, 10, 6))
  x = cross_encoder_inputs(w_ids, w_mask, q_ids, q_mask)
  assert x["cross_input_ids"].shape == (6, 9 + 20 - 1) and x["cross_align"].shape == (6, 20)
  for b in range(6):
    nq, nw = q_mask[b].sum(), w_mask[b].sum()
    row = x["cross_input_ids"][b]
    assert row[:nq].tolist() == q_ids[b, :nq].tolist()  # [CLS] question [SEP]
    for t in range(1, nw):  # every window token but its [CLS], at its aligned position
      assert row[x["cross_align"][b, t]] == w_ids[b, t]
      assert x["cross_token_type_ids"][b, x["cross_align"][b, t]] == 1
    assert x["cross_attention_mask"][b].sum() == nq + nw - 1
    assert x["cross_token_type_ids"][b, :nq].sum() == 0


def test_reader_logits_cut_to_each_batch_equal_the_full_width_ones():
  """`reading.reader_logits` takes rows longest first and cuts each batch to its longest input: at
  every real window position its logits equal those of the full-width rows, matched by row."""
  rng = np.random.default_rng(2)
  lengths = np.array([70, 9, 33, 120, 12, 64, 5, 90, 41])
  w_ids, w_mask = random_rows(rng, 9, 128, lengths)
  q_ids, q_mask = random_rows(rng, 4, 16, np.array([16, 4, 9, 6]))
  zeros = np.zeros(9, np.int32)
  windows = PassageWindows(w_ids.astype(np.int32), w_mask, w_mask > 0, w_mask > 0, zeros[:, None],
                           zeros[:, None], zeros, zeros)
  questions = np.array([0, 1, 2, 3, 0, 1, 2, 3, 1, 0, 3])
  features = RCFeatures(windows, q_ids.astype(np.int32), q_mask, questions,
                        np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 0]), np.zeros(11, np.int32),
                        np.zeros(11, np.int32))
  config = dataclasses.replace(TINY, max_position_embeddings=160)
  reader = CrossEncoderReader(config, rngs=nnx.Rngs(0))
  rows = np.array([10, 3, 0, 7, 1, 9, 5, 2, 8, 6, 4])
  full = cross_batch(features, rows)
  want = np.asarray(reader.window_logits(*(jnp.asarray(full[k]) for k in (
      "cross_input_ids", "cross_attention_mask", "cross_token_type_ids", "cross_align"))))
  seen = []
  for part, logits in reader_logits(reader, features, rows, mesh=make_mesh(), batch_size=8):
    assert logits.shape == (len(part), 128, 2)
    for row, got in zip(part.tolist(), logits):
      i = rows.tolist().index(row)
      n = w_mask[features.window_index[row]].sum()
      np.testing.assert_allclose(got[:n], want[i, :n], rtol=1e-5, atol=1e-5)
    seen += part.tolist()
  assert sorted(seen) == sorted(rows.tolist())
  widths = full["cross_attention_mask"].sum(1)
  assert [widths[rows.tolist().index(r)] for r in seen] == sorted(widths, reverse=True)


def test_the_teacher_head_learns_gold_spans_at_the_window_positions():
  """A few steps on one batch: the reader's start/end over the window's context tokens (read
  through the alignment) reach the gold positions."""
  rng = np.random.default_rng(1)
  w_ids, w_mask = random_rows(rng, 4, 16, np.array([16, 12, 9, 14]))
  q_ids, q_mask = random_rows(rng, 4, 6, np.array([6, 4, 5, 3]))
  context = (np.arange(16)[None] >= 1) & (np.arange(16)[None] < w_mask.sum(1)[:, None] - 1)
  batch = {**cross_encoder_inputs(w_ids, w_mask, q_ids, q_mask), "context_mask": context,
           "start_positions": np.array([3, 5, 2, 7]), "end_positions": np.array([4, 7, 2, 9])}
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  reader = CrossEncoderReader(TINY, rngs=nnx.Rngs(0))
  full = reader(batch["cross_input_ids"], batch["cross_attention_mask"],
                batch["cross_token_type_ids"])
  aligned = reader.window_logits(batch["cross_input_ids"], batch["cross_attention_mask"],
                                 batch["cross_token_type_ids"], batch["cross_align"])
  np.testing.assert_array_equal(aligned[2, 5], full[2, batch["cross_align"][2, 5]])
  optimizer = nnx.Optimizer(reader, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(reader, optimizer):
    (loss, (metrics, _)), grads = nnx.value_and_grad(
        lambda m: teacher_loss(m, batch, {}), has_aux=True)(reader)
    optimizer.update(reader, grads)
    return loss, metrics

  first, _ = step(reader, optimizer)
  for _ in range(60):
    loss, metrics = step(reader, optimizer)
  assert float(loss) < 0.1 * float(first) and float(metrics["start_accuracy"]) == 1.0


def fingerprint(**changes):
  return {"teacher": "t1", "step": 6, "data": "d1", "length": 8, **changes}


def test_logits_file_resumes_and_refuses_another_fingerprint(tmp_path):
  rows = np.array([7, 3, 11, 0, 5, 9, 2])
  calls = []

  def compute(part):
    calls.append(part.tolist())
    return np.stack([np.outer(part, np.ones(8)), -np.outer(part, np.ones(8))], 1)

  directory = tmp_path / "logits"
  write_teacher_logits(directory, fingerprint(), rows, compute, shard_rows=3)
  assert calls == [[7, 3, 11], [0, 5, 9], [2]]
  # A killed run: the manifest says incomplete and one shard never landed -> only it is computed.
  manifest = json.loads((directory / "manifest.json").read_text())
  (directory / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
  for file in (directory / "shard_00001").iterdir():
    file.unlink()
  (directory / "shard_00001").rmdir()
  calls.clear()
  write_teacher_logits(directory, fingerprint(), rows, compute, shard_rows=3)
  assert calls == [[0, 5, 9]]
  logits = TeacherLogits(directory, data="d1", length=8)
  got = logits.batch(np.array([9, 7, 2]))
  np.testing.assert_array_equal(got["teacher_start_logits"][:, 0], [9, 7, 2])
  np.testing.assert_array_equal(got["teacher_end_logits"][:, 3], [-9, -7, -2])
  assert logits.missing(np.array([1, 7, 40])) == 2
  with pytest.raises(DataError, match="no teacher logits for 1"):
    logits.batch(np.array([7, 1]))
  with pytest.raises(DataError, match="another teacher.*teacher: 't1' -> 't2'"):
    write_teacher_logits(directory, fingerprint(teacher="t2"), rows, compute, shard_rows=3)
  with pytest.raises(DataError, match="other training data"):
    TeacherLogits(directory, data="d2", length=8)
  with pytest.raises(DataError, match="no complete teacher logits"):
    TeacherLogits(tmp_path / "none", data="d1", length=8)


def test_logits_of_several_processes_have_one_writer(tmp_path, monkeypatch):
  """Every process of a multi-process teacher computes the logits (a collective call), and all
  of them wrote the same shards' one temporary folder: one removed another's half-written one
  and the renames failed. Two "processes" (threads, a barrier each) now compute in step and the
  main one alone writes; each returns the complete manifest."""
  import threading
  import time

  from dpjax.io import atomic_directory
  rows = np.arange(10)
  sync = threading.Barrier(2)
  writers, errors, manifests = [], [], []

  def compute(part):
    sync.wait()  # the collective call: both processes at once
    return np.stack([np.outer(part, np.ones(8)), -np.outer(part, np.ones(8))], 1)

  def slow_directory(final, **kwargs):  # the window in which another writer would collide
    writers.append(threading.current_thread().name)
    time.sleep(0.05)
    return atomic_directory(final, **kwargs)

  monkeypatch.setattr("dpjax.data.teacher_logits.atomic_directory", slow_directory)

  def process(main):
    try:
      manifests.append(write_teacher_logits(tmp_path / "logits", fingerprint(), rows, compute,
                                            shard_rows=4, main=main,
                                            barrier=lambda name: sync.wait()))
    except Exception as e:  # noqa: BLE001 (reported below)
      errors.append(e)

  threads = [threading.Thread(target=process, args=(main,), name=f"p{int(not main)}")
             for main in (True, False)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not errors and len(manifests) == 2 and all(m["complete"] for m in manifests)
  assert writers == ["p0"] * 3  # three shards, written by the main process only
  got = TeacherLogits(tmp_path / "logits", data="d1", length=8).batch(np.array([9, 0]))
  np.testing.assert_array_equal(got["teacher_start_logits"][:, 0], [9, 0])


@pytest.mark.parametrize("grouped", [False, True])
def test_distillation_adds_lambda_times_the_kl(grouped):
  config = Settings.of(load_config(CONFIG, ["train.loss.prebatch_size=0",
                                             "train.loss.lambda_distill=3.0"]))
  from dpjax.models import create_model
  rng = np.random.default_rng(2)
  model = create_model(config.model)
  b, g, length = 4, (2 if grouped else 1), 16
  w_ids, w_mask = random_rows(rng, b, length, np.full(b, length))
  q_ids, q_mask = random_rows(rng, b * g, 6, np.full(b * g, 6))
  batch = {"input_ids": w_ids, "attention_mask": w_mask,
           "context_mask": np.arange(length)[None].repeat(b, 0) > 0,
           "passage_ids": np.arange(b, dtype=np.int32),
           "start_positions": rng.integers(1, length, b * g),
           "end_positions": rng.integers(1, length, b * g),
           "question_input_ids": q_ids, "question_attention_mask": q_mask}
  if grouped:  # two padding slots: the logged distill is over the filled ones, as the loss
    batch["question_valid"] = np.array([1, 1, 1, 0, 1, 0, 1, 1], bool)
  plain, (metrics, _) = compute_loss(model, batch, {}, 0, config.train.loss)
  teacher = {"teacher_start_logits": rng.normal(size=(b * g, length)).astype(np.float32),
             "teacher_end_logits": rng.normal(size=(b * g, length)).astype(np.float32)}
  distilled, (metrics, _) = compute_loss(model, {**batch, **teacher}, {}, 0, config.train.loss)
  assert float(metrics["distill"]) > 0
  assert float(distilled) == pytest.approx(float(plain) + 3.0 * float(metrics["distill"]),
                                           rel=1e-5)


def test_grouped_batches_carry_each_slots_teacher_logits(tmp_path):
  assert run.main(["data", "--config", CONFIG, "--workdir", str(tmp_path)]) == 0
  from dpjax.data import Tokenizer, data_files, load_rc_split
  config = load_config(CONFIG)
  train = load_rc_split(data_files(config.data, tmp_path)["train"],
                        Tokenizer.from_pretrained(config.model.tokenizer), config.data)
  n = len(train.features)
  marks = np.arange(n, dtype=np.float32)
  write_teacher_logits(tmp_path / "logits", fingerprint(data="x", length=96), np.arange(n),
                       lambda part: np.stack([np.outer(marks[part], np.ones(96))] * 2, 1))
  teacher = TeacherLogits(tmp_path / "logits", data="x", length=96)
  for batches in (TrainBatches(train.features, 4, 0, teacher=teacher),
                  GroupedBatches(train.features, 2, 3, 0, teacher=teacher)):
    for step in range(3):
      batch, rows = batches(step), batches.rows(step)
      np.testing.assert_array_equal(batch["teacher_start_logits"][:, 0], rows)
      assert len(batch["teacher_start_logits"]) == len(batch["start_positions"])


def test_teacher_command_then_distilled_training(tmp_path):
  base = ["--config", CONFIG, "--workdir", str(tmp_path)]
  assert run.main(["teacher"] + base) == 0
  teacher = json.loads((tmp_path / "teacher" / "results.json").read_text())
  assert {"rc_exact_match", "rc_f1"} <= set(teacher)
  manifest = json.loads((tmp_path / "teacher" / "logits" / "manifest.json").read_text())
  assert manifest["complete"] and manifest["rows"] > 0
  assert run.main(["teacher"] + base) == 0  # done: resumes to the same manifest
  assert json.loads((tmp_path / "teacher" / "logits" / "manifest.json").read_text()) == manifest
  from dpjax.io import workdir_lock
  with workdir_lock(tmp_path / "teacher" / "teacher.lock"):  # a run writing its logits
    assert run.main(["teacher"] + base) == 2  # the logits too are one run's at a time
  _logits_are_the_teachers(tmp_path, manifest)
  assert run.main(["train"] + base + ["--set", "train.teacher_logits=teacher/logits"]) == 0
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert all("distill" in r for r in logged if r["split"] == "train")
  # Logits of other training data (another synthetic draw) are refused before training.
  other = tmp_path / "other"
  (other / "teacher").mkdir(parents=True)
  (other / "teacher" / "logits").symlink_to(tmp_path / "teacher" / "logits",
                                            target_is_directory=True)
  assert run.main(["train", "--config", CONFIG, "--workdir", str(other), "--set",
                   "train.teacher_logits=teacher/logits", "--set", "data.seed=1"]) == 2
  assert not (other / "checkpoints").exists()


def _logits_are_the_teachers(workdir, manifest):
  """Each written row holds the restored teacher's own logits of that row (float16)."""
  from dpjax.checkpoint import restore_params
  from dpjax.data import Tokenizer, data_files, load_rc_split
  from dpjax.models.reader import create_reader
  config = load_config(CONFIG)
  train = load_rc_split(data_files(config.data, workdir)["train"],
                        Tokenizer.from_pretrained(config.model.tokenizer), config.data)
  reader = create_reader(Settings.of(config).model)
  assert restore_params(workdir / "teacher" / "checkpoints", reader) is not None
  written = TeacherLogits(workdir / "teacher" / "logits", data=manifest["fingerprint"]["data"],
                          length=config.data.max_seq_length)
  rows = np.flatnonzero(written.slot >= 0)[::7][:12]
  full = cross_batch(train.features, rows)
  want = np.asarray(reader.window_logits(*(jnp.asarray(full[k]) for k in (
      "cross_input_ids", "cross_attention_mask", "cross_token_type_ids", "cross_align"))))
  got = written.batch(rows)
  for i, row in enumerate(rows):
    n = train.features.windows.attention_mask[train.features.window_index[row]].sum()
    np.testing.assert_allclose(got["teacher_start_logits"][i, :n], want[i, :n, 0], atol=2e-3,
                               rtol=2e-3)
    np.testing.assert_allclose(got["teacher_end_logits"][i, :n], want[i, :n, 1], atol=2e-3,
                               rtol=2e-3)


def test_recipe_study_report(tmp_path):
  """experiments/studies/recipe_study.py over two tiny runs and a teacher: scores, paired test, keys."""
  from conftest import load_script
  study = load_script("experiments/studies/recipe_study.py")
  assert study.mcnemar_p("1100", "1100") == (0, 0, 1.0)
  assert study.mcnemar_p("1111111111", "0000000000")[2] == pytest.approx(2 / 2 ** 10)
  assert study.p_text(study.mcnemar_p("1" * 3000, "0" * 3000)[2]) == "< 1e-300"  # underflows
  assert study.p_text(2 / 2 ** 10) == "0.00195" and study.p_text(None) == "-"
  base, other = tmp_path / "base", tmp_path / "other"
  assert run.main(["train", "--config", CONFIG, "--workdir", str(base)]) == 0
  assert run.main(["train", "--config", CONFIG, "--workdir", str(other), "--set",
                   "train.learning_rate=1e-3"]) == 0
  out = tmp_path / "recipe.json"
  validation = tmp_path / "validation.json"  # as validation_experiment.py writes it, elsewhere
  validation.write_text(json.dumps({"models": {
      "b": {"workdir": "/root/w/recipe/base", "subcorpora": {"H32": {"em@1": 7.5},
                                                               "full": {"em@1": 6.0}}},
      "o": {"workdir": "/root/w/recipe/other", "subcorpora": {"H32": {"em@1": 9.0}}}}}))
  results = study.main(["--config", CONFIG, "--run", f"base={base}::cmd a", "--run",
                        f"lr1e-3={other}:12.5::cmd b", "--best", "lr1e-3", "--out", str(out),
                        "--validation", str(validation)])
  assert (results["cpu_baseline"]["h32_em1"], results["cpu_baseline"]["full_em1"]) == (7.5, 6.0)
  assert results["cpu_best"]["full_em1"] is None  # the spec's 12.5 (H32) wins over the file
  assert set(json.loads(out.read_text())) >= {"cpu_baseline", "cpu_best", "teacher", "runs"}
  best = results["cpu_best"]
  assert best["name"] == "lr1e-3" and best["h32_em1"] == 12.5 and best["command"] == "cmd b"
  assert best["delta_em"] == pytest.approx(best["rc_em"] - results["cpu_baseline"]["rc_em"])
  assert results["teacher"] is None and results["runs"][0]["train_seconds"] > 0
  assert "| lr1e-3 |" in out.with_suffix(".md").read_text()
  # The baseline's workdir wiped: taken from the report (hits included), still paired.
  first = json.loads(out.read_text())["runs"]
  shutil.rmtree(base)
  again = study.main(["--config", CONFIG, "--run", f"base={base}::cmd a", "--run",
                      f"lr1e-3={other}::cmd b", "--previous", str(out), "--out",
                      str(tmp_path / "again.json")])
  assert again["runs"][0]["rc_em"] == first[0]["rc_em"] and again["runs"][0]["hits"]
  assert [r["p_value"] for r in again["runs"]] == [r["p_value"] for r in first]


def test_recipe_study_pairs_or_says_unpaired():
  """A run is paired with the baseline by McNemar where both per-question hits are known, keeps
  an earlier report's paired test otherwise, and falls back to the (marked) unpaired
  two-proportion test only when neither exists."""
  from conftest import load_script
  study = load_script("experiments/studies/recipe_study.py")
  # 50% vs 40% of 1,000 questions: z = 4.495, two-sided p = 6.96e-6.
  assert study.two_proportion_p(50.0, 40.0, 1000) == pytest.approx(6.96e-6, rel=1e-2)
  assert study.two_proportion_p(40.0, 40.0, 1000) == pytest.approx(1.0)
  shown = {"rc_f1": 0.0, "h32_em1": None, "full_em1": None, "train_seconds": 60.0, "command": "c"}
  base = {"name": "b", "rc_em": 40.0, "questions": 1000, **shown}
  new = {"name": "x", "rc_em": 50.0, "questions": 1000, "hits": "1" * 500 + "0" * 500, **shown}
  old = {"name": "y", "rc_em": 41.0, "questions": 1000, "p_value": 0.3, "only_this": 5,
         "only_baseline": 3, **shown}
  runs = [base, new, old]
  study.compare(runs)
  report = {"runs": runs, "cpu_best": None, "teacher": None}
  assert "| x | 50.00 | 0.00 | +10.00 | - / - | 6.97e-06 (unpaired) |" in study.render(report, "c")
  assert base["p_value"] is None and base["delta_em"] == 0
  assert new["test"] == "unpaired" and new["only_this"] is None
  assert new["p_value"] == pytest.approx(6.96e-6, rel=1e-2)
  assert (old["test"], old["p_value"], old["only_this"]) == ("mcnemar", 0.3, 5)
  base["hits"] = "1" * 400 + "0" * 600
  study.compare(runs)
  assert new["test"] == "mcnemar" and (new["only_this"], new["only_baseline"]) == (100, 0)
  assert "(unpaired) |" not in study.render(report, "c")


def test_score_scale_is_a_temperature_of_the_phrase_scores():
  """score_scale s: the unified loss of questions x s; s = 1 is the loss as before."""
  from dpjax.models import create_model
  rng = np.random.default_rng(3)
  b, length = 4, 16
  w_ids, w_mask = random_rows(rng, b, length, np.full(b, length))
  q_ids, q_mask = random_rows(rng, b, 6, np.full(b, 6))
  batch = {"input_ids": w_ids, "attention_mask": w_mask,
           "context_mask": np.arange(length)[None].repeat(b, 0) > 0,
           "passage_ids": np.arange(b, dtype=np.int32),
           "start_positions": rng.integers(1, length, b),
           "end_positions": rng.integers(1, length, b),
           "question_input_ids": q_ids, "question_attention_mask": q_mask}
  losses_by_scale = {}
  for scale in (1.0, 0.5, 2.0):
    config = Settings.of(load_config(CONFIG, ["train.loss.prebatch_size=0",
                                              f"train.loss.score_scale={scale}"]))
    model = create_model(config.model)
    losses_by_scale[scale] = float(compute_loss(model, batch, {}, 0, config.train.loss)[0])
  default = Settings.of(load_config(CONFIG, ["train.loss.prebatch_size=0"]))
  plain = float(compute_loss(create_model(default.model), batch, {}, 0, default.train.loss)[0])
  assert losses_by_scale[1.0] == plain
  assert len({round(v, 5) for v in losses_by_scale.values()}) == 3


def test_teacher_logits_refuse_other_rows_of_the_same_count(tmp_path):
  """Logits written for one run's examples are not those of another run with as many examples
  (another train.seed): the directory says so instead of returning the old rows as complete."""
  fingerprint = {"teacher": "t", "step": 1, "data": "d", "length": 4}
  compute = lambda part: np.zeros((len(part), 2, 4), np.float32)
  write_teacher_logits(tmp_path, fingerprint, np.array([0, 1, 2]), compute)
  assert write_teacher_logits(tmp_path, fingerprint, np.array([0, 1, 2]), compute)["complete"]
  with pytest.raises(DataError, match="other rows"):
    write_teacher_logits(tmp_path, fingerprint, np.array([3, 4, 5]), compute)


def test_a_distillation_run_records_its_teachers_logits():
  """A phrase run resumed after `run.py teacher` rewrote the logits with another teacher went
  on, mixing two teachers: the checkpoint records the logits' fingerprint (`_inputs`), and
  `_restore` refuses other ones (as for a re-mined hard-negatives file, test_validation)."""
  from types import SimpleNamespace

  from dpjax.training import _inputs
  train = Settings.of(load_config("experiments/demo.py:tiny")).train
  def teacher(step):
    return SimpleNamespace(teacher=SimpleNamespace(fingerprint={"params": "abc", "step": step}),
                           hard_negatives=None)
  assert _inputs(train, teacher(6)) == _inputs(train, teacher(6))
  assert _inputs(train, teacher(6)) != _inputs(train, teacher(7))
  assert set(_inputs(train, teacher(6))) == {"teacher_logits"}
  assert _inputs(train, SimpleNamespace()) == {}
