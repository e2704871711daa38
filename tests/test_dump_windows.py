"""The dump-windows study (experiments/studies/dump_windows.py) end to end on the tiny pipeline."""
import json

import pytest

from conftest import REPO, load_script

import run

study = load_script("experiments/studies/dump_windows.py")

# Windows of 40 tokens every 8: the tiny corpus's passages take several each.
METRICS = ("em@1", "em@10", "top1", "top20")
SHORT = ["--set", "data.max_seq_length=40", "--set", "data.doc_stride=8"]


@pytest.mark.slow
def test_dump_windows_study_tiny(tmp_path, monkeypatch):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(["train"] + base) == 0
  monkeypatch.chdir(REPO)
  out = tmp_path / "windows.json"
  assert study.main(base + ["--min-context", "0", "4", "12", "--out", str(out)] + SHORT) == 0
  results = json.loads(out.read_text())
  first, *others = results["runs"]
  assert [(r["max_seq_length"], r["min_context"]) for r in results["runs"]] == [
      (40, 0), (40, 4), (40, 12)]  # the config's window length
  # Every value stores the same tokens, fewer windows re-encode fewer of them.
  assert len({r["tokens_stored"] for r in results["runs"]}) == 1
  assert first["tokens_encoded"] > max(r["tokens_encoded"] for r in others)
  assert all(r["tokens_encoded"] > r["tokens_stored"] + r["windows"] for r in results["runs"])
  assert first["vectors_vs_first"] == {"max_abs_diff": 0.0, "mean_abs_diff": 0.0,
                                       "tokens_moved": 0.0}
  # Other windows give some tokens other contexts: their vectors move.
  assert all(0 < r["vectors_vs_first"]["tokens_moved"] < 1 for r in others)
  n = results["questions"]
  for r in others:  # the paired counts are those of the figures' difference
    for metric in ("em@1", "top20"):
      t = r["vs_first"][metric]
      assert r[metric] - first[metric] == pytest.approx(100 * (t["only_this"] - t["only_that"])
                                                        / n)
      assert 0 <= t["p"] <= 1
  # The questions are answered as `run.py eval` answers them over the same dump.
  # (with the dump's own windows: eval refuses a dump of other windows than the config's)
  assert run.main(["eval"] + base + SHORT + ["--set", "index.dump_name='dump_windows_40_mc4'",
                                             "--set", "index.dump_min_context=4"]) == 0
  report = json.loads((tmp_path / "open_eval_dump_windows_40_mc4_Flat.json").read_text())
  for metric in ("em@1", "em@10", "top1", "top20"):
    assert others[0][metric] == pytest.approx(report[metric])
  text = out.with_suffix(".md").read_text()
  assert "| 40 / 12 | " in text and "--set data.doc_stride=8" in text
  assert all("vs_shipped" not in r for r in results["runs"])  # the config ships 0, the first
  # Run again, the complete dumps are reused (same figures); the config's own value (0) not
  # first: each other one is paired with it too.
  again = tmp_path / "again.json"
  assert study.main(base + ["--min-context", "4", "0", "--out", str(again)] + SHORT) == 0
  four, zero = json.loads(again.read_text())["runs"]
  for key in ("tokens_encoded", "tokens_stored", "windows", "dump_seconds", "hits", *METRICS):
    assert four[key] == others[0][key] and zero[key] == first[key]
  assert four["vs_shipped"] == others[0]["vs_first"] and "vs_shipped" not in zero
  assert "Paired with 40 / 0" in again.with_suffix(".md").read_text()
  # Longer windows (index.dump_max_seq_length, up to the model's positions) split fewer
  # passages: fewer windows, fewer tokens encoded, the same tokens stored.
  longer = tmp_path / "longer.json"
  assert study.main(base + ["--max-seq-length", "40", "64", "--min-context", "4",
                            "--out", str(longer)] + SHORT) == 0
  short, wide = json.loads(longer.read_text())["runs"]
  assert short["hits"] == others[0]["hits"] and wide["max_seq_length"] == 64
  assert wide["windows"] < short["windows"] and wide["tokens_encoded"] < short["tokens_encoded"]
  assert wide["tokens_stored"] == short["tokens_stored"]
  with pytest.raises(Exception, match="windows of 1000 tokens .* exceed the model's 512 "):
    study.main(base + ["--max-seq-length", "1000", "--min-context", "4", "--out", str(longer)])
  # A dump of other settings under the same name is refused, naming it.
  with pytest.raises(Exception, match="dump_windows_40_mc0 holds a dump with other settings"):
    study.main(base + ["--min-context", "0", "--out", str(again), "--set",
                       "data.max_seq_length=40", "--set", "data.doc_stride=16"])
  with pytest.raises(SystemExit, match="distinct values"):
    study.main(base + ["--min-context", "4", "4", "--out", str(again)])
