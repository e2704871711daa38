"""The re-reading window study (experiments/benchmarks/reread_window.py) end to end on the tiny
trained workdir: its training-question rows, its dev evals paired and its timing."""
import json
import shutil

from conftest import load_script

study = load_script("experiments/benchmarks/reread_window.py")


def test_the_window_study_chooses_evaluates_and_times(tiny_workdir, tmp_path):
  workdir = tmp_path / "demo"
  shutil.copytree(tiny_workdir, workdir)
  out = tmp_path / "reread_window.json"
  settings = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir),
              "--set", "index.reread=2", "--flat-set", "index.top_k=10"]
  assert study.main([*settings, "--window", "1000", "--window", "12", "--tolerance", "100",
                     "--dev", "--time", "--batch1", "2", "--batches64", "1",
                     "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  rows = result["choice"]["rows"]
  assert [r["window"] for r in rows] == [None, 12, 1000]
  # a window wider than every passage reads them whole; a narrow one reads fewer tokens
  assert rows[2]["tokens_per_question"] == rows[0]["tokens_per_question"] > 0
  assert rows[2]["em@1"] == rows[0]["em@1"] and rows[2]["top1"] == rows[0]["top1"]
  assert 0 < rows[1]["tokens_per_question"] < rows[0]["tokens_per_question"]
  assert result["choice"]["chosen"] == 12  # the smallest within the (wide) tolerance
  dev = result["dev"]
  assert set(dev["rows"]) == {"whole passages", "window 12", "Flat"}
  assert dev["rows"]["window 12"]["reread_window"] == 12
  assert dev["rows"]["Flat"]["reread"] == 0 and dev["rows"]["whole passages"]["reread"] == 2
  assert set(dev["paired"]) == {"window 12 vs whole passages", "window 12 vs Flat"}
  assert set(result["speed"]["rows"]) == {"Flat", "whole passages", "window 12"}
  assert "| 12 |" in out.with_suffix(".md").read_text()


def test_a_window_is_timed_without_a_choice(tiny_workdir, tmp_path):
  out = tmp_path / "timed.json"
  assert study.main(["--config", "experiments/demo.py:tiny", "--workdir", str(tiny_workdir),
                     "--set", "index.reread=2", "--skip-choice", "--use-window", "12", "--time",
                     "--batch1", "2", "--batches64", "1", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert "choice" not in result and set(result["speed"]["rows"]) == {"whole passages",
                                                                     "window 12"}
  assert "Training questions" not in out.with_suffix(".md").read_text()
