"""Query-side fine-tuning on the tiny pipeline."""
import json

import jax
import numpy as np
from conftest import load_script
from flax import nnx

from dpjax.config import load_config
from dpjax.models import create_model
from dpjax.workdir import restore_model
from dpjax.objectives import qsft_loss

import run


def _leaves(module):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module, nnx.Param))]


def test_qsft_loss_without_positives_is_finite():
  config = load_config("experiments/demo.py:tiny")
  model = create_model(config.model)
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


def test_qsft_keeps_the_phrase_encoder(tmp_path):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path),
          "--set", "index.specs=['Flat','IVFauto,SQ8']"]
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
  # The schedule is sized by the steps an epoch takes (its questions with a positive), not by
  # all training questions: the learning rate decays to 0 over the run.
  first_steps = result["epochs"][0]["questions_with_positive"] // 8
  assert result["epochs"][0]["step"] == first_steps
  assert result["schedule_steps"] == 2 * first_steps
  assert np.isfinite([e["train_loss"] for e in result["epochs"]]).all()
  config = load_config("experiments/demo.py:tiny", qsft[5::2])
  before, _ = restore_model(config, tmp_path)
  config.eval.checkpoint = "qsft"
  after, step = restore_model(config, tmp_path)
  assert step == result["best_step"]
  for a, b in zip(_leaves(before.phrase_encoder), _leaves(after.phrase_encoder)):
    assert a.tobytes() == b.tobytes()  # bit-identical: the index stays valid
  assert _leaves(before.filter_head)[0].tobytes() == _leaves(after.filter_head)[0].tobytes()
  assert any(not np.array_equal(a, b) for a, b in zip(_leaves(before.query_start_encoder),
                                                      _leaves(after.query_start_encoder)))
  # The fine-tuned model answers over the same index (the dump's fingerprint still matches).
  assert run.main(["eval"] + qsft + ["--set", "eval.checkpoint=qsft"]) == 0
  # Quantisation-aware: candidates reconstructed by the IVF-SQ8 quantizer.
  assert run.main(["qsft"] + qsft + ["--set", "qsft.index=IVFauto_SQ8", "--set",
                                     "qsft.quantized=True", "--set", "qsft.epochs=1"]) == 0
  quantized = json.loads((tmp_path / "qsft_results_IVFauto_SQ8_quantized.json").read_text())
  assert quantized["quantized"] and len(quantized["epochs"]) == 1
  # The report of results/qsft.md, from this workdir: one row per run.
  report = load_script("experiments/report_qsft_filter.py")
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

  from dpjax.data import DataError
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
