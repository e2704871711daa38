"""Pulse: run.py's entry points on the tiny configs."""
import json
import subprocess
import sys

import pytest

from conftest import REPO
from dpjax.index import hybrid_weights as fusion
from test_tensorboard import read_scalars

import run


def test_eval_rc_tiny(tmp_path):
  assert run.main(["eval_rc", "--config", "experiments/demo.py:tiny", "--workdir",
                   str(tmp_path), "--set", "eval.max_answer_length=3"]) == 0
  scores = json.loads((tmp_path / "rc_eval.json").read_text())
  assert scores["count"] > 0 and 0 <= scores["exact_match"] <= 100
  predictions = json.loads((tmp_path / "rc_predictions.json").read_text())
  assert len(predictions) == scores["count"]


def test_data_mode_and_bad_file(tmp_path, capsys):
  assert run.main(["data", "--config", "experiments/demo.py:tiny", "--workdir",
                   str(tmp_path)]) == 0
  assert "0 records skipped" in capsys.readouterr().out
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "train-v1.1.json").write_text("{\"data\": [")
  (bad / "dev-v1.1.json").write_text("{}")
  # A malformed file ends the run with a one-line error, not a traceback.
  result = subprocess.run(  # a workdir of its own: tmp_path was made with demo.py's config
      [sys.executable, "run.py", "data", "--config", "experiments/squad.py:tiny", "--workdir",
       str(tmp_path / "squad"), "--set", f"data.dir={bad}"], cwd=REPO, capture_output=True,
      text=True)
  assert result.returncode == 2
  assert "train-v1.1.json: invalid JSON at line 1" in result.stderr
  assert "Traceback" not in result.stderr


def _train_losses(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


BASE = ["train", "--config", "experiments/demo.py:tiny", "--set", "train.checkpoint_every=3"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The workdir of an unbroken tiny training run."""
  workdir = tmp_path_factory.mktemp("straight")
  assert run.main(BASE + ["--workdir", str(workdir)]) == 0
  return workdir


def test_lengths_past_the_encoders_positions_are_refused(tmp_path, straight, caplog):
  """Windows or questions longer than the encoder's 512 positions would embed as NaN: training
  and every command that restores the model refuse them (exit 2), naming the field."""
  assert run.main(BASE + ["--workdir", str(tmp_path / "w"), "--set",
                          "data.max_seq_length=600"]) == 2
  assert "data.max_seq_length = 600: the encoder (random) has only 512 positions" in caplog.text
  assert not (tmp_path / "w" / "checkpoints").exists()
  search = ["search", "--config", "experiments/demo.py:tiny", "--workdir", str(straight),
            "--query", "who?", "--set", "data.max_query_length=513"]
  assert run.main(search) == 2
  assert "data.max_query_length = 513: the encoder (random) has only 512" in caplog.text


def test_train_resume_gives_the_same_losses(tmp_path, straight):
  """A run stopped after a checkpoint and resumed logs exactly the losses of an unbroken run."""
  base = BASE
  workdir, straight = straight, _train_losses(straight)
  assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]  # crosses epochs (2 steps each)

  broken = tmp_path / "broken"
  assert run.main(base + ["--workdir", str(broken), "--set", "train.stop_at_step=4"]) == 0
  assert not (broken / "results.json").exists()
  # Resuming with settings that change the training is refused (exit 2), before any step.
  assert run.main(base + ["--workdir", str(broken), "--set", "train.loss.lambda_inb=1.0"]) == 2
  # Step 4 was saved at the stop; a save of step 5 that died half-way must not be used, and
  # metrics logged after the last checkpoint by the dead run must not be duplicated.
  (broken / "checkpoints" / "5.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  with (broken / "metrics.jsonl").open("a") as f:
    f.write(json.dumps({"step": 5, "split": "train", "loss": -1.0}) + "\n")
  assert run.main(base + ["--workdir", str(broken)]) == 0
  assert _train_losses(broken) == straight
  assert (json.loads((broken / "results.json").read_text())
          == json.loads((workdir / "results.json").read_text()))
  # Running the finished run again reuses its evaluation of the last step, not repeating it.
  evaluations = (broken / "metrics.jsonl").read_text().count('"split": "dev"')
  assert evaluations >= 1
  assert run.main(base + ["--workdir", str(broken)]) == 0
  assert (broken / "metrics.jsonl").read_text().count('"split": "dev"') == evaluations
  assert (json.loads((broken / "results.json").read_text())
          == json.loads((workdir / "results.json").read_text()))
  # Killed after the last checkpoint and its evaluation, before results.json: the evaluation is
  # done again and replaces its record (it was logged twice for the step).
  (broken / "results.json").unlink()
  assert run.main(base + ["--workdir", str(broken)]) == 0
  assert (broken / "metrics.jsonl").read_text().count('"split": "dev"') == evaluations
  assert (json.loads((broken / "results.json").read_text())
          == json.loads((workdir / "results.json").read_text()))
  # The TensorBoard scalars mirror metrics.jsonl through the resumes: the logged losses at
  # their steps, without the dead run's line past the checkpoint.
  assert read_scalars(broken / "tensorboard" / "train")["train/loss"] == straight


def test_logged_losses_are_the_means_since_the_last_log(tmp_path, straight):
  """Logged every 3 steps, the run logs the mean of each 3 steps' losses (`steps_averaged`: 3)
  and the learning rate of the step logged."""
  def train_records(workdir):
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"]
  every = train_records(straight)
  assert [r["steps_averaged"] for r in every] == [1] * 6
  assert run.main(BASE + ["--workdir", str(tmp_path), "--set", "train.log_every=3"]) == 0
  logged = train_records(tmp_path)
  assert [(r["step"], r["steps_averaged"]) for r in logged] == [(3, 3), (6, 3)]
  for record, steps in zip(logged, (every[:3], every[3:])):
    assert record["loss"] == pytest.approx(sum(r["loss"] for r in steps) / 3, rel=1e-5)
    assert record["learning_rate"] == steps[-1]["learning_rate"]
  assert logged[0]["loss"] != every[2]["loss"]


def test_open_domain_pipeline_tiny(tmp_path, capsys, caplog):
  """train -> dump -> index -> eval -> search on the tiny config, through run.py."""
  workdir = str(tmp_path)
  base = ["--config", "experiments/demo.py:tiny", "--workdir", workdir]
  for mode in ("train", "dump", "index", "eval"):
    assert run.main([mode] + base) == 0, mode
  report = json.loads((tmp_path / "open_eval_Flat.json").read_text())
  assert report["questions"] == 12 and 0 <= report["em@1"] <= report["em@10"] <= 100
  manifest = json.loads((tmp_path / "dump" / "manifest.json").read_text())
  assert manifest["model"]["tokenizer"] == "minilm-l6"  # what the Python API tokenizes with
  assert report["top1"] <= report["top5"] <= report["top20"] <= report["top100"]
  predictions = (tmp_path / "open_predictions_Flat.jsonl").read_text().splitlines()
  assert len(predictions) == 12
  # The exact index searched by JAX on the devices (what `auto` does on a GPU): same answers.
  assert run.main(["eval"] + base + ["--set", "index.search_device=jax"]) == 0
  assert (tmp_path / "open_predictions_Flat.jsonl").read_text().splitlines() == predictions
  # An approximate index is compared with Flat's top-1 (same spans: a tiny corpus, nprobe 256).
  ivf = base + ["--set", "index.specs=['IVFauto,SQ8']", "--set", "index.search_index=IVFauto_SQ8"]
  assert run.main(["index"] + ivf) == 0 and run.main(["eval"] + ivf) == 0
  agreement = json.loads((tmp_path / "open_eval_IVFauto_SQ8.json").read_text())
  assert agreement["top1_agreement_with_flat"] >= 90.0
  # The factory string names the index's folder too (IVFauto,SQ8 -> indexes/IVFauto_SQ8).
  assert run.main(["eval"] + base + ["--set", "index.search_index=IVFauto,SQ8"]) == 0
  assert not list(tmp_path.glob("open_eval_*,*"))  # its files are the folder's name's
  assert run.main(["search"] + base + ["--query", "Who was the mentor of Ne Chithashoum?"]) == 0
  assert "1. " in capsys.readouterr().out
  _hybrid_pipeline(tmp_path, base, caplog)


def _hybrid_pipeline(tmp_path, base, caplog):
  """index.sparse through run.py: refused without a BM25 index, which `index` builds and weighs;
  weight 0 answers as the dense search, file for file; overlapping spans merged or not."""
  hybrid = base + ["--set", "index.sparse=True"]
  assert run.main(["eval"] + hybrid) == 2
  assert "no BM25 index" in caplog.text and "run.py index --set index.sparse=True" in caplog.text
  tune = ["--set", "index.sparse_tune_questions=40", "--set", "index.specs=[]"]
  assert run.main(["index"] + hybrid + tune) == 0
  bm25 = json.loads((tmp_path / "dump" / "indexes" / "bm25" / "sparse_manifest.json").read_text())
  scores = bm25["weight_tuning"]["scores"]  # by `fusion.pair_key`: the best mean, then smaller
  best = max((scores[f"{w:g},{s:g}"]["em@1"] + scores[f"{w:g},{s:g}"]["top1"], -w, -s)
             for w in fusion.WEIGHTS for s in fusion.SENTENCE_WEIGHTS)
  assert (bm25["weight"], bm25["sentence_weight"]) == (-best[1], -best[2]) and len(scores) == 40
  assert 0 < bm25["weight_tuning"]["questions"] <= 40 and "train" in bm25["weight_tuning"]["file"]
  manifest = tmp_path / "dump" / "indexes" / "bm25" / "sparse_manifest.json"
  assert run.main(["index"] + hybrid + tune) == 0  # the same settings: kept, not chosen again
  assert json.loads(manifest.read_text()) == bm25
  assert run.main(["index"] + hybrid + tune + ["--set", "index.sparse_passages=5"]) == 0
  assert json.loads(manifest.read_text())["weight_tuning"]["passages"] == 5
  assert run.main(["index"] + hybrid + tune) == 0
  bm25 = json.loads(manifest.read_text())
  assert bm25["weight_tuning"]["passages"] == 20
  assert run.main(["eval"] + hybrid) == 0
  report = json.loads((tmp_path / "open_eval_Flat_hybrid.json").read_text())
  assert report["hybrid"]["weight"] == bm25["weight"] and report["questions"] == 12
  assert report["hybrid"]["sentence_weight"] == bm25["sentence_weight"]
  assert run.main(["eval"] + hybrid + ["--set", "index.sparse_weight=0.0"]) == 0
  dense = (tmp_path / "open_predictions_Flat.jsonl").read_text()
  assert (tmp_path / "open_predictions_Flat_hybrid_w0_s0.jsonl").read_text() == dense
  assert json.loads((tmp_path / "open_eval_Flat_hybrid.json").read_text()) == report
  assert run.main(["eval"] + base + ["--set", "index.merge_spans=False"]) == 0
  apart = [json.loads(line)["spans"] for line in
           (tmp_path / "open_predictions_Flat_unmerged.jsonl").read_text().splitlines()]
  merged = [json.loads(line)["spans"] for line in dense.splitlines()]
  assert all(m[0] == a[0] for m, a in zip(merged, apart))  # the best answer is the same
  assert not any(map(_overlapping, merged))  # (test_hybrid.py: merging on a corpus that has them)
  assert json.loads((tmp_path / "open_eval_Flat_unmerged.json").read_text())["merge_spans"] is False


def _overlapping(spans) -> bool:
  return any(a[0] == b[0] and a[1] < b[2] and b[1] < a[2]
             for i, a in enumerate(spans) for b in spans[:i])


def test_sigterm_stops_at_a_step_with_a_checkpoint_and_resumes_exactly(tmp_path, monkeypatch,
                                                                         straight):
  """SIGTERM mid-run: a checkpoint of the step it stopped at (not a checkpoint_every multiple),
  exit status 143, the handler restored; the resumed run logs the unbroken run's losses."""
  import os
  import signal

  from dpjax import training as train
  base = BASE
  before = signal.getsignal(signal.SIGTERM)
  log = train._log

  def log_and_signal(run_, done, metrics):
    log(run_, done, metrics)
    if done == 2:
      os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled between steps

  monkeypatch.setattr(train, "_log", log_and_signal)
  broken = tmp_path / "broken"
  assert run.main(base + ["--workdir", str(broken)]) == 143
  assert signal.getsignal(signal.SIGTERM) == before
  assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["2"]
  assert not (broken / "results.json").exists()
  monkeypatch.setattr(train, "_log", log)
  assert run.main(base + ["--workdir", str(broken)]) == 0
  assert _train_losses(broken) == _train_losses(straight)


def test_metrics_since_the_last_log_survive_a_stop_between_logs(tmp_path, monkeypatch):
  """log_every 4, checkpoint_every 3: a SIGTERM at step 2, or a crash after checkpoint 3, lost
  the metrics summed since the last log (the next record averaged fewer steps than an unbroken
  run's). The checkpoint's meta now holds them: every train record equals the unbroken run's."""
  import os
  import signal

  from dpjax import training as train
  base = BASE + ["--set", "train.log_every=4"]
  straight = tmp_path / "straight"
  assert run.main(base + ["--workdir", str(straight)]) == 0
  accumulate = train._accumulate

  def records(workdir):
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_per_sec")}
            for line in (workdir / "metrics.jsonl").read_text().splitlines()
            if '"train"' in line]

  def stop_at(step, how):
    def hook(run_, done, metrics):
      accumulate(run_, done, metrics)
      if done == step:
        how()
    monkeypatch.setattr(train, "_accumulate", hook)

  def crash():
    raise RuntimeError("killed")

  broken, crashed = tmp_path / "broken", tmp_path / "crashed"
  stop_at(2, lambda: os.kill(os.getpid(), signal.SIGTERM))
  assert run.main(base + ["--workdir", str(broken)]) == 143
  stop_at(4, crash)  # after checkpoint 3, before the log of step 4
  with pytest.raises(RuntimeError, match="killed"):
    run.main(base + ["--workdir", str(crashed)])
  monkeypatch.setattr(train, "_accumulate", accumulate)
  for workdir in (broken, crashed):
    assert run.main(base + ["--workdir", str(workdir)]) == 0
    assert records(workdir) == records(straight) and len(records(straight)) == 2


_CACHED = """
import collections
import jax, jax.numpy as jnp
from dpjax.distributed import enable_compilation_cache
seen = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **kw: seen.update([event]))
print(enable_compilation_cache())
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((96, 96))).block_until_ready()
print(seen["/jax/compilation_cache/compile_requests_use_cache"],
      seen["/jax/compilation_cache/cache_hits"])
"""


def test_compilation_cache_serves_the_next_process(tmp_path):
  import os
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(DPJAX_COMPILATION_CACHE=str(tmp_path / "xla"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

  def run_once():
    out = subprocess.run([sys.executable, "-c", _CACHED], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    folder, requests, hits = out.stdout.split()
    return folder, int(requests), int(hits)

  folder, requests, hits = run_once()
  assert folder == str(tmp_path / "xla") and requests > 0 and hits == 0  # compiled, written
  assert len(list((tmp_path / "xla").glob("*-cache"))) == requests
  assert run_once() == (folder, requests, requests)  # every program read back
  env["DPJAX_COMPILATION_CACHE"] = "off"
  folder, _, hits = run_once()
  assert (folder, hits) == ("None", 0)


def test_the_workdir_remembers_its_config_and_refuses_another(tmp_path, caplog):
  """The run that makes a workdir saves its resolved config there (without the API key); later
  runs take it when --config is left out, and a --config of another experiment (other model or
  data fields, with the overrides the workdir was made with) is refused in one line."""
  from dpjax.config import SAVED_CONFIG, load_config
  workdir, tiny = str(tmp_path / "w"), "experiments/demo.py:tiny"
  saved_file = tmp_path / "w" / SAVED_CONFIG
  assert run.main(["data", "--workdir", workdir]) == 2
  assert f"give --config experiments/<name>.py: {workdir} has no saved config" in caplog.text
  assert not (tmp_path / "w").exists()
  empty = tmp_path / "empty"
  empty.mkdir()  # a run refused before it makes anything saves nothing
  assert run.main(["index", "--config", tiny, "--workdir", str(empty)]) == 2  # no dump
  assert not any(empty.iterdir())
  assert run.main(["data", "--config", tiny, "--workdir", workdir, "--set", "data.seed=3",
                   "--set", "serve.api_key=s3cret-key"]) == 0
  saved = json.loads(saved_file.read_text())
  assert saved == {"config": tiny, "set": ["data.seed=3"],
                   "resolved": load_config(tiny, ["data.seed=3"]).to_dict()}
  assert "s3cret-key" not in saved_file.read_text()
  assert run.main(["data", "--workdir", workdir, "--set", "eval.batch_size=3"]) == 0
  assert run.main(["data", "--config", tiny, "--workdir", workdir, "--set", "data.seed=3"]) == 0
  for spec, message in (
      ("experiments/demo.py", "model.init 'random' (--config experiments/demo.py: 'pretrained')"),
      ("experiments/squad.py:tiny", "data.dev_entities 4 (--config experiments/squad.py:tiny: "
                                    "None)")):
    caplog.clear()
    assert run.main(["data", "--config", spec, "--workdir", workdir]) == 2, spec
    assert (f"{workdir} was made with another config ({tiny}, {saved_file}): " in caplog.text
            and message in caplog.text and "leave --config out" in caplog.text), caplog.text
  assert json.loads(saved_file.read_text()) == saved  # written once, by the run that made it


def test_a_refused_run_leaves_no_new_workdir(tmp_path):
  """A dump from a mistyped workdir (no checkpoints) is refused and leaves no empty folder."""
  workdir = tmp_path / "mistyped"
  assert run.main(["dump", "--config", "experiments/demo.py:tiny", "--workdir",
                   str(workdir)]) == 2
  assert not workdir.exists()
