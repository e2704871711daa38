"""experiments/gpu_check.py end to end on the tiny config, its deadline, and its report."""
import json

import pytest

from conftest import load_script

gpu_check = load_script("experiments/gpu_check.py")
report = load_script("experiments/report.py")

TINY = ["--config", "experiments/demo.py:tiny"]


@pytest.mark.slow
def test_gpu_check_tiny_end_to_end(tmp_path):
  """Every stage runs; each figure is the one its run wrote; the report renders once a run."""
  out, work = tmp_path / "out", tmp_path / "w"
  assert gpu_check.main(["--workdir", str(work), "--out", str(out), *TINY, "--stages", "train",
                         "chain", "dump_warm", "step", "--set", "index.sparse_tune_questions=12",
                         "--step-args",
                         "--batch 8 --length 32 --steps 1 --warmup 1"]) == 0
  result = json.loads((out / "gpu_check.json").read_text())
  assert {k: v["rc"] for k, v in result["stages"].items()} == {
      "default.train": 0, "default.dump": 0, "default.index": 0, "default.eval": 0,
      "default.hybrid_index": 0, "default.hybrid_eval": 0, "dump_warm": 0, "step": 0}
  figures = result["figures"]
  rc = json.loads((work / "default" / "results.json").read_text())
  assert figures["rc_exact_match"] == rc["rc_exact_match"] and figures["count"] == rc["count"]
  open_eval = json.loads((work / "default" / "open_eval_Flat.json").read_text())
  for key in ("em@1", "em@10", "top1", "top20", "mrr@20"):
    assert figures[key] == open_eval[key]
  assert figures["questions"] == open_eval["questions"] > 0
  assert open_eval["hybrid"] is None  # the dense row is dense whatever the config's default
  hybrid = json.loads((work / "default" / "open_eval_Flat_hybrid.json").read_text())
  for key in ("em@1", "top1", "top20"):
    assert figures[f"hybrid_{key}"] == hybrid[key]
  assert hybrid["hybrid"]["weight_tuning"]["questions"] == 12
  manifest = json.loads((work / "default" / "dump" / "manifest.json").read_text())
  assert figures["dump_stored_tokens_per_s"] == manifest["num_tokens"] / manifest["seconds"]
  assert figures["dump_cold_tokens_per_s"] < figures["dump_stored_tokens_per_s"]
  warm = json.loads((work / "default" / "dump_warm" / "manifest.json").read_text())
  assert figures["dump_warm_tokens_per_s"] == warm["num_tokens"] / warm["seconds"]
  assert figures["step_ms"] == 1e3 * result["speed"]["step"]["median_step_s"] > 0
  assert result["candidates"]["default"]["recipe"]["train.batch_size"] == 8
  assert result["command"].startswith("python experiments/gpu_check.py --workdir ")
  assert [t["figure"] for t in result["targets"]] == [k for k, _, _ in gpu_check.TARGETS]
  assert all(isinstance(t["met"], bool) for t in result["targets"])

  rendered = tmp_path / "results" / "gpu_check.json"
  history = tmp_path / "results" / "gpu_runs.jsonl"
  argv = [str(out / "gpu_check.json"), "--out", str(rendered), "--history", str(history),
          "--note", "a note"]
  for _ in range(2):  # rendering the same run again appends no second history line
    assert report.gpu_check_report(argv) == 0
  markdown = rendered.with_suffix(".md").read_text()
  assert f"| passage Top-1 | {open_eval['top1']:.2f} |" in markdown
  assert markdown.rstrip().endswith("a note")
  runs = [json.loads(line) for line in history.read_text().splitlines()]
  assert len(runs) == 1 and runs[0]["figures"]["top1"] == open_eval["top1"]


def test_deadline_keeps_what_finished(tmp_path):
  """A deadline that ends the training: the stage is killed, later ones skipped, and
  gpu_check.json is still written, with no figure that was not measured."""
  out = tmp_path / "out"
  assert gpu_check.main(["--workdir", str(tmp_path / "w"), "--out", str(out), *TINY,
                         "--deadline", "3", "--stages", "train", "chain", "step"]) == 1
  result = json.loads((out / "gpu_check.json").read_text())
  assert result["stages"]["default.train"]["rc"] == "timeout"
  assert result["stages"]["step"] == {"rc": "skipped: deadline"}
  assert "default.dump" not in result["stages"]  # no trained model: no chain
  assert "em@1" not in result["figures"] and "step_ms" not in result["figures"]
  assert all(t["met"] is None for t in result["targets"])


def _part(stages: dict, dump_seconds: float) -> dict:
  dump = {"num_tokens": 1000, "seconds": dump_seconds, "stored_tokens_per_s": 1000 / dump_seconds}
  return {"command": "c", "commit": "abc", "device": "d", "elapsed_s": 1.0, "stages": stages,
          "candidates": {"default": {"recipe": {}, "dump": dump,
                                     "open": {"top1": 50.0, "questions": 10,
                                              "questions_per_s": 5.0}}},
          "speed": {}}


def test_merge_keeps_the_first_finished_record_of_a_stage():
  """A resumed part finds the dump complete (a wall below the dump's own seconds): the first
  part's record of the dump stays, the second part's index replaces the first's timeout."""
  first = _part({"default.dump": {"rc": 0, "wall_s": 4.0},
                 "default.index": {"rc": "timeout", "wall_s": 1.0}}, dump_seconds=2.0)
  second = _part({"default.dump": {"rc": 0, "wall_s": 1.5},
                  "default.index": {"rc": 0, "wall_s": 3.0}}, dump_seconds=2.0)
  merged = gpu_check.merge([first, second])
  assert merged["stages"] == {"default.dump": {"rc": 0, "wall_s": 4.0},
                              "default.index": {"rc": 0, "wall_s": 3.0}}
  assert merged["figures"]["dump_cold_tokens_per_s"] == 1000 / 4.0
  assert len(merged["parts"]) == 2
  # The second part alone: a dump found complete is no cold dump.
  assert "dump_cold_tokens_per_s" not in gpu_check.figures(second)


def test_merge_drops_the_speed_of_a_resumed_dump():
  """A dump cut short in one part and finished in the next: its tokens are both parts', its
  seconds the second's, so no tokens/s figure is made of them."""
  first = _part({"default.dump": {"rc": "timeout", "wall_s": 4.0}}, dump_seconds=2.0)
  second = _part({"default.dump": {"rc": 0, "wall_s": 3.0}}, dump_seconds=2.0)
  merged = gpu_check.merge([first, second])
  assert merged["dump_resumed"] and "dump_cold_tokens_per_s" not in merged["figures"]
  assert "dump_stored_tokens_per_s" not in merged["figures"]


def test_read_train_leaves_out_a_line_cut_by_a_kill(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      '{"split": "train", "step": 10, "examples_per_sec": 100.0}\n{"split": "train", "st')
  assert gpu_check.read_train(tmp_path, 8) == {"train_step_ms_median": 80.0, "steps": 10}
