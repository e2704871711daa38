"""The separately trained token filter and its threshold sweep, on the tiny pipeline."""
import json
import shutil

import numpy as np
import pytest

from conftest import load_script

from dpjax.index.dump_reader import Dump
from dpjax.index.manifest import read_manifest, write_manifest
from dpjax.errors import DumpError
from dpjax.index.phrase_index import PhraseIndex
from dpjax.token_filter import rewrite_dump_logits, train_head

import run


def test_filter_training_sweep_and_filtered_index(tmp_path, capsys, caplog):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  for mode in ("train", "dump"):
    assert run.main([mode] + base) == 0
  before = Dump.load(tmp_path / "dump").filter_logits.copy()
  assert (before == 0).all()  # the head is zero-initialised and not trained jointly
  assert run.main(["filter"] + base + ["--set", "filter.epochs=3",
                                       "--set", "filter.batch_size=8"]) == 0
  result = json.loads((tmp_path / "filter_results.json").read_text())
  assert 0 < result["dev_auc_pr"] <= 1
  assert result["dev_auc_pr"] == max(h["dev_auc_pr"] for h in result["history"])
  tokens = [s["tokens"] for s in result["sweep"]]
  assert tokens == sorted(tokens, reverse=True) and result["sweep"][0]["threshold"] is None
  for s in result["sweep"][1:]:  # each threshold keeps about its fraction of the tokens
    assert abs(s["kept_fraction"] - s["tokens"] / tokens[0]) < 1e-9
  chosen = result["chosen"]
  assert chosen["em@1"] >= result["sweep"][0]["em@1"] - 1.0
  # The dump now carries the trained head's logits, and an index built with the chosen
  # threshold holds exactly the tokens the sweep kept.
  after = Dump.load(tmp_path / "dump").filter_logits
  assert not (after == 0).all()
  threshold = chosen["threshold"]
  if threshold is not None:
    assert run.main(["index"] + base + ["--set", f"index.filter_threshold={threshold}"]) == 0
    manifest = json.loads(next((tmp_path / "dump" / "indexes").glob("Flat_filter*/"
                                                                     "index_manifest.json"))
                          .read_text())
    assert manifest["num_tokens"] == chosen["tokens"]
  assert "token filter: dev AUC-PR" in capsys.readouterr().out
  assert (tmp_path / "filter_head.npz").is_file()
  # An index kept its tokens by the logits of the head then: a rewrite by another head (here
  # over a rewrite killed half-way, which `run.py filter` can start again) makes it refused.
  median = float(np.median(after.astype(np.float32).max(1)))
  assert run.main(["index"] + base + ["--set", f"index.filter_threshold={median}"]) == 0
  name = f"Flat_filter{median:g}"
  PhraseIndex(tmp_path / "dump", name)  # the dump's head: fine
  dump_dir = tmp_path / "dump"
  write_manifest(dump_dir, {**read_manifest(dump_dir), "filter_rewrite_incomplete": True})
  with np.load(tmp_path / "filter_head.npz") as head:
    rewrite_dump_logits(dump_dir, 2 * head["kernel"], head["bias"])
  assert "filter_rewrite_incomplete" not in read_manifest(dump_dir)
  with pytest.raises(DumpError, match="another filter head"):
    PhraseIndex(dump_dir, name)
  # The report of results/filter.md, from this workdir.
  report = load_script("experiments/studies/report_qsft_filter.py")
  assert report.main(["--workdir", str(tmp_path), "--out-dir", str(tmp_path / "results")]) == 0
  text = (tmp_path / "results" / "filter.md").read_text()
  assert f"{result['dev_auc_pr']:.4f}" in text and (tmp_path / "results" / "filter.png").is_file()
  # The workdir's checkpoint replaced by another model's: filter and QSFT refuse the dump (they
  # read its vectors with this model's head and question encoders, and filter rewrote its logits).
  assert run.main(["index"] + base) == 0  # (QSFT searches the Flat index)
  other = tmp_path / "other"
  assert run.main(["train", "--config", "experiments/demo.py:tiny", "--workdir", str(other),
                   "--set", "model.seed=1"]) == 0
  shutil.rmtree(tmp_path / "checkpoints")
  shutil.copytree(other / "checkpoints", tmp_path / "checkpoints")
  logits = Dump.load(tmp_path / "dump").filter_logits.copy()
  for mode in ("filter", "qsft"):
    caplog.clear()
    assert run.main([mode] + base) == 2, mode
    assert "was dumped by another model than this workdir's checkpoint" in caplog.text, mode
  assert (Dump.load(tmp_path / "dump").filter_logits == logits).all()  # not rewritten


def test_filter_head_trains_on_fewer_windows_than_a_batch():
  """A training set smaller than filter.batch_size still takes steps (it took none: the head
  stayed at its start for every epoch, with a NaN loss)."""
  rng = np.random.default_rng(0)
  n, length, dim = 5, 7, 3
  vectors = rng.normal(size=(n, length, dim)).astype(np.float16)
  mask = np.ones((n, length), bool)
  start = np.zeros((n, length), bool)
  start[:, 2] = True
  end = np.zeros((n, length), bool)
  end[:, 4] = True
  data = (vectors, mask, start, end)
  kernel, bias = np.zeros((dim, 2), np.float32), np.zeros(2, np.float32)
  new_kernel, new_bias, history = train_head(data, data, kernel, bias, epochs=2,
                                             learning_rate=0.1, batch_size=8)
  assert all(np.isfinite(h["train_loss"]) for h in history[1:])
  assert history[-1]["dev_auc_pr"] > history[0]["dev_auc_pr"]
  assert not np.array_equal(new_bias, bias) or not np.array_equal(new_kernel, kernel)
