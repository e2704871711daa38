"""experiments/studies/behaviour_check.py's comparisons (the chains themselves are not run)."""
import json

import pytest

from conftest import load_script

check = load_script("experiments/studies/behaviour_check.py")


def test_timings_are_dropped_and_nothing_else():
  figures = {"em@1": 1.0, "search_seconds": 2.0, "questions_per_sec_batch64": 3.0, "wall_s": 4,
             "step_ms": 5, "num_steps": 6, "top_spans": [{"elapsed": 1, "score": 7.5}]}
  assert check._no_timings(figures) == {"em@1": 1.0, "num_steps": 6, "top_spans": [{"score": 7.5}]}


def test_compare_names_the_first_difference():
  assert check.compare([[1, 2.5], [2, 1.5]], [[1, 2.5], [2, 1.5]]) == {
      "verdict": "identical", "compared": 2}
  different = check.compare([[1, 2.5], [2, 1.5]], [[1, 2.5], [2, 1.5000001]])
  assert different["verdict"] == "different"
  assert different["first_difference"] == {"index": 1, "old": [2, 1.5], "new": [2, 1.5000001]}
  assert check.compare([1], [1, 2])["first_difference"] == {"index": 1, "old": None, "new": 2}
  assert check.compare({"a": 1, "b": 2}, {"a": 1, "b": 3})["first_difference"] == {
      "key": "b", "old": 2, "new": 3}


def test_losses_of_the_first_steps_as_written(tmp_path):
  lines = [{"step": s, "split": "train", "loss": 1.0 / s, "examples_per_sec": s} for s in (1, 2, 3)]
  lines.insert(1, {"step": 2, "split": "dev", "rc_exact_match": 10.0})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
  read = check.readers(2)
  assert read["metrics.jsonl: loss of steps 1-2"](tmp_path) == [[1, 1.0], [2, 0.5]]
  assert read["metrics.jsonl: other figures of steps 1-2"](tmp_path) == [
      {"step": 1, "split": "train"}, {"step": 2, "split": "train"}]
  assert check._read(read["results.json (dev RC figures)"], tmp_path) == "missing: results.json"


def test_figures_only_the_new_commit_writes_are_listed_not_ignored():
  same = check.compare({"em@1": 50.0}, {"em@1": 50.0, "hits": "01"})
  assert same["verdict"] == "identical" and same["added_by_new"] == ["hits"]
  changed = check.compare({"em@1": 50.0}, {"em@1": 51.0, "hits": "01"})
  assert changed["verdict"] == "different" and changed["first_difference"]["key"] == "em@1"
  assert check.compare({"em@1": 50.0, "gone": 1}, {"em@1": 50.0})["verdict"] == "different"


def test_a_file_the_new_commit_renames_is_read_under_its_new_name(tmp_path):
  for side, name in (("old", "open_eval_Flat.json"), ("new", "open_eval_Flat_unmerged.json")):
    (tmp_path / f"workdir_{side}").mkdir()
    (tmp_path / f"workdir_{side}" / name).write_text(json.dumps({"em@1": 50.0, "search_s": 1}))
  read = check.readers(3, {"open_eval_Flat.json": "open_eval_Flat_unmerged.json"})[
      "open_eval_Flat.json (open-domain figures)"]
  assert read(tmp_path / "workdir_old") == read(tmp_path / "workdir_new") == {"em@1": 50.0}
  unrenamed = check.readers(3)["open_eval_Flat.json (open-domain figures)"]
  with pytest.raises(FileNotFoundError):
    unrenamed(tmp_path / "workdir_new")
