"""Pulse: run.py's entry points on the tiny configs."""
import json
import subprocess
import sys

from conftest import REPO

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
  result = subprocess.run(
      [sys.executable, "run.py", "data", "--config", "experiments/squad.py:tiny", "--workdir",
       str(tmp_path), "--set", f"data.dir={bad}"], cwd=REPO, capture_output=True, text=True)
  assert result.returncode == 2
  assert "train-v1.1.json: invalid JSON at line 1" in result.stderr
  assert "Traceback" not in result.stderr
