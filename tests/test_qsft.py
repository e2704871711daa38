"""Query-side fine-tuning on the tiny pipeline."""
import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import load_script
from flax import nnx

from dpjax.config import load_config
from dpjax.models import create_model
from dpjax.loading import restore_model
from dpjax.objectives import qsft_loss
from dpjax.settings import Settings

import run


def _leaves(module):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module, nnx.Param))]


def test_qsft_loss_without_positives_is_finite():
  model = create_model(Settings.of(load_config("experiments/demo.py:tiny")).model)
  rng = np.random.default_rng(0)
  b, k, d = 4, 6, model.config.hidden_size
  positive = np.zeros((b, k), bool)
  positive[0, 2] = True  # only the first question has a positive
  batch = {"question_input_ids": rng.integers(1000, 2000, (b, 8)).astype(np.int32),
           "question_attention_mask": np.ones((b, 8), np.int32),
           "candidate_start": rng.standard_normal((b, k, d)).astype(np.float32),
           "candidate_end": rng.standard_normal((b, k, d)).astype(np.float32),
           "candidate_valid": np.ones((b, k), bool), "candidate_positive": positive}
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p):
    return qsft_loss(nnx.merge(graphdef, p, rest), batch)[0]

  loss, grads = jax.value_and_grad(loss_fn)(params)
  assert np.isfinite(loss) and loss > 0
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  batch["candidate_positive"] = np.zeros((b, k), bool)  # no positive at all: zero, not NaN
  loss, grads = jax.value_and_grad(loss_fn)(params)
  assert loss == 0 and all((np.asarray(g) == 0).all() for g in jax.tree.leaves(grads))


def test_qsft_keeps_the_phrase_encoder(tmp_path, caplog):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path),
          "--set", "index.specs=['Flat','IVFauto,SQ8','compact:PQ6']"]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0
  # Document level (L_doc: phrases of the gold article are positives), so that the barely trained
  # tiny model has enough questions with a positive among its top 50.
  qsft = base + ["--set", "qsft.top_k=50", "--set", "qsft.epochs=2", "--set",
                 "qsft.batch_size=8", "--set", "qsft.learning_rate=1e-3", "--set",
                 "qsft.level=document"]
  assert run.main(["qsft"] + qsft) == 0
  result = json.loads((tmp_path / "qsft_results_Flat.json").read_text())
  assert len(result["epochs"]) == 2 and result["epochs"][0]["questions_with_positive"] >= 8
  # An epoch steps over its questions with a positive; the schedule follows all the steps taken.
  steps = [e["questions_with_positive"] // 8 for e in result["epochs"]]
  assert [e["step"] for e in result["epochs"]] == [steps[0], steps[0] + steps[1]]
  assert result["schedule_steps"] == sum(steps)
  assert result["improved"] == any(e["em@1"] > result["before"]["em@1"] for e in result["epochs"])
  assert ("QSFT did not raise dev EM@1" in caplog.text) == (not result["improved"])
  # The kept epoch against the start, question by question (the hits of each evaluation).
  kept = [e for e in result["epochs"] if e["step"] == result["best_step"]][0]
  before, after = result["before"]["hits"]["em@1"], kept["hits"]["em@1"]
  assert len(before) == result["dev_questions"] and set(before + after) <= {"0", "1"}
  assert 100 * after.count("1") / len(after) == pytest.approx(kept["em@1"])
  paired = result["best_epoch_vs_before"]
  assert paired["epoch"] == kept["epoch"]
  assert paired["gained"] - paired["lost"] == after.count("1") - before.count("1")
  assert 0 < paired["p_value"] <= 1
  metric_lines = (tmp_path / "qsft_metrics.jsonl").read_text().splitlines()
  assert len(metric_lines) == 3 and "hits" not in metric_lines[1]
  # Each epoch's last step at its rate by the run's progress (warm-up 0.1 of the run, lr 1e-3).
  for epoch, record in enumerate(result["epochs"]):
    progress = epoch + (steps[epoch] - 1) / steps[epoch]
    assert record["last_learning_rate"] == pytest.approx(
        1e-3 * min(progress / 0.2, (2 - progress) / 1.8), rel=1e-5)
  assert np.isfinite([e["train_loss"] for e in result["epochs"]]).all()
  s = Settings.of(load_config("experiments/demo.py:tiny", qsft[5::2]))
  before, _ = restore_model(s.model, s.data, s.eval, tmp_path)
  after, step = restore_model(s.model, s.data, dataclasses.replace(s.eval, checkpoint="qsft"),
                              tmp_path)
  assert step == result["best_step"]
  for a, b in zip(_leaves(before.phrase_encoder), _leaves(after.phrase_encoder)):
    assert a.tobytes() == b.tobytes()  # bit-identical: the index stays valid
  assert _leaves(before.filter_head)[0].tobytes() == _leaves(after.filter_head)[0].tobytes()
  assert any(not np.array_equal(a, b) for a, b in zip(_leaves(before.query_start_encoder),
                                                      _leaves(after.query_start_encoder)))
  # The fine-tuned model answers over the same index (the dump's fingerprint still matches).
  assert run.main(["eval"] + qsft + ["--set", "eval.checkpoint=qsft"]) == 0
  # Its question encoder ranks a compact index's candidates, the trained one scores the re-read
  # spans (index.reread_checkpoint); the same checkpoint twice is the plain re-reading.
  reread = qsft + ["--set", "eval.checkpoint=qsft", "--set", "index.search_index=compact_PQ6",
                   "--set", "index.reread=2", "--set", "eval.throughput_questions=64"]
  for scorer, name, scored_by in (("latest", "_reread2_scored_latest_qsft", "latest"),
                                  ("qsft", "_reread2_qsft", None)):
    assert run.main(["eval"] + reread + ["--set", f"index.reread_checkpoint={scorer}"]) == 0
    report = json.loads((tmp_path / f"open_eval_compact_PQ6{name}.json").read_text())
    assert (report["checkpoint"], report["reread_scored_by"]) == ("qsft", scored_by)
  assert run.main(["eval"] + reread + ["--set", "index.reread_checkpoint=best"]) == 2
  assert "no best checkpoint" in caplog.text
  # Quantisation-aware: candidates reconstructed by the IVF-SQ8 quantizer.
  assert run.main(["qsft"] + qsft + ["--set", "qsft.index=IVFauto_SQ8", "--set",
                                     "qsft.quantized=True", "--set", "qsft.epochs=1"]) == 0
  quantized = json.loads((tmp_path / "qsft_results_IVFauto_SQ8_quantized.json").read_text())
  assert quantized["quantized"] and len(quantized["epochs"]) == 1
  # A compact index: candidates are its codes decoded (it holds nothing else).
  from dpjax.errors import ConfigError
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.qsft import CandidateVectors
  compact = PhraseIndex(tmp_path / "dump", "compact_PQ6")
  with pytest.raises(ConfigError, match="compact index.*qsft.quantized=True"):
    CandidateVectors(compact, quantized=False)
  ranks = np.array([[0, 5, -1], [compact.num_vectors - 1, 5, 2]])
  got = CandidateVectors(compact, quantized=True)(ranks)
  decoded = compact.compact.codec.sa_decode(np.asarray(compact.compact.codes[[0, 5, 2]]))
  assert got.shape == (2, 3, decoded.shape[1]) and not got[0, 2].any()
  np.testing.assert_array_equal(got[0, :2], decoded[:2])
  np.testing.assert_array_equal(got[1, 1:], decoded[1:])
  last = compact.compact.codec.sa_decode(np.asarray(compact.compact.codes[-1:]))
  np.testing.assert_array_equal(got[1, 0], last[0])
  assert run.main(["qsft"] + qsft + ["--set", "qsft.index=compact_PQ6", "--set",
                                     "qsft.quantized=True", "--set", "qsft.epochs=1"]) == 0
  coded = json.loads((tmp_path / "qsft_results_compact_PQ6_quantized.json").read_text())
  assert coded["quantized"] and len(coded["epochs"]) == 1
  assert coded["epochs"][0]["questions_with_positive"] >= 8
  # The report of results/qsft.md, from this workdir: one row per run.
  report = load_script("experiments/studies/report_qsft_filter.py")
  assert report.main(["--workdir", str(tmp_path), "--out-dir", str(tmp_path / "results")]) == 0
  text = (tmp_path / "results" / "qsft.md").read_text()
  assert "| Flat | stored (exact) |" in text and "| IVFauto_SQ8 | quantizer reconstruction" in text


def test_sample_questions_is_seeded_and_keeps_file_order():
  from dpjax.data.questions import sample_questions
  questions = [{"id": i} for i in range(100)]
  sample = sample_questions(questions, 10, seed=0)
  assert sample == sample_questions(questions, 10, seed=0)
  assert sample != sample_questions(questions, 10, seed=1)
  ids = [q["id"] for q in sample]
  assert len(set(ids)) == 10 and ids == sorted(ids) and ids != list(range(10))
  assert sample_questions(questions, 0, seed=0) is questions
  assert sample_questions(questions, 500, seed=0) is questions


def test_one_qsft_run_per_workdir(tmp_path):
  import os
  import subprocess
  import sys

  import pytest

  from dpjax.errors import DataError
  from dpjax.qsft import workdir_lock
  lock = tmp_path / "qsft.lock"
  lock.write_text(str(os.getppid()))  # a live process holds it
  with pytest.raises(DataError, match="another QSFT run"):
    with workdir_lock(lock):
      pass
  assert lock.read_text() == str(os.getppid())
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  lock.write_text(gone)  # left by a killed run: taken over
  with workdir_lock(lock):
    assert lock.read_text().split()[0] == str(os.getpid())
  assert not lock.exists()  # released
  with workdir_lock(lock):
    with pytest.raises(DataError, match="another QSFT run|could not take"):
      lock.write_text(str(os.getppid()))  # deleted by hand and taken by another run
      with workdir_lock(lock):
        pass
  assert lock.read_text() == str(os.getppid())  # a run releases only its own lock


def test_epoch_schedule_decays_to_zero_by_progress_whatever_the_epochs_lengths():
  """QSFT's learning rate: a warm-up over warmup_fraction of the run, then a linear decay that
  reaches 0 at the run's last step, each epoch its share however many steps it takes (epoch 1:
  4 steps, epoch 2: 8, whose questions with a positive are only known once it starts)."""
  from dpjax.qsft import epoch_schedule
  peak, epochs, lengths = 1e-3, 2, (4, 8)
  rates, first = [], 0
  for epoch, steps in enumerate(lengths):
    schedule = epoch_schedule(peak, 0.25, epochs, epoch, first, steps)
    rates += [float(schedule(np.int32(count))) for count in range(first, first + steps + 1)]
    first += steps
  end = rates.pop(4)  # epoch 1's rate at its end (the count epoch 2 starts at) is epoch 2's first
  assert end == pytest.approx(rates[4])
  progress = [c / 4 for c in range(5)] + [1 + c / 8 for c in range(1, 9)]
  want = [peak * min(p / 0.5, (2 - p) / 1.5) for p in progress]
  assert rates == pytest.approx(want, rel=1e-6, abs=1e-12)
  assert rates[2] == pytest.approx(peak) and rates[-1] == 0.0 and min(rates[3:-1]) > 0.0
  assert all(a > b for a, b in zip(rates[2:], rates[3:]))  # decays across the epochs' boundary
