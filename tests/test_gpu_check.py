"""experiments/gpu_check.py end to end on the tiny config, its deadline, and its report."""
import json

import jax
import pytest

from conftest import load_script

gpu_check = load_script("experiments/gpu_check.py")
report = load_script("experiments/report.py")

TINY = ["--config", "experiments/demo.py:tiny"]
MINILM = {"hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1536}


@pytest.mark.slow
def test_gpu_check_tiny_end_to_end(tmp_path):
  """Every stage runs; each figure is the one its run wrote; the report renders once a run."""
  out, work = tmp_path / "out", tmp_path / "w"
  assert gpu_check.main(["--workdir", str(work), "--out", str(out), *TINY, "--stages", "train",
                         "chain", "dump_warm", "step", "hybrid", "eval_profile", "--set",
                         "index.sparse_tune_questions=12",
                         "--step-args",
                         "--batch 8 --length 32 --steps 1 --warmup 1"]) == 0
  result = json.loads((out / "gpu_check.json").read_text())
  assert {k: v["rc"] for k, v in result["stages"].items()} == {
      "default.train": 0, "default.dump": 0, "default.index": 0, "default.eval": 0,
      "default.hybrid_index": 0, "default.hybrid_eval": 0, "dump_warm": 0, "step": 0,
      "eval_profile": 0}
  # The hybrid search ran alongside the dense eval, and the report says so.
  stages = result["stages"]
  assert stages["default.hybrid_index"]["start_s"] < (
      stages["default.eval"]["start_s"] + stages["default.eval"]["wall_s"])
  assert stages["default.eval"]["start_s"] >= (
      stages["default.index"]["start_s"] + stages["default.index"]["wall_s"])
  assert result["figures"]["eval_alongside_hybrid"] is True
  # The profiled eval's summary names the eval; the chain's own eval files are untouched.
  assert "dpjax/main/eval.py" in (out / "eval_profile.txt").read_text()
  mine, chain = (work / d / "open_eval_Flat.json" for d in ("default_profile", "default"))
  assert not mine.is_symlink() and chain.stat().st_mtime < mine.stat().st_mtime
  figures = result["figures"]
  rc = json.loads((work / "default" / "results.json").read_text())
  assert figures["rc_exact_match"] == rc["rc_exact_match"] and figures["count"] == rc["count"]
  open_eval = json.loads((work / "default" / "open_eval_Flat.json").read_text())
  for key in ("em@1", "em@10", "top1", "top20", "mrr@20"):
    assert figures[key] == open_eval[key]
  assert figures["questions"] == open_eval["questions"] > 0
  assert open_eval["hybrid"] is None  # the dense row is dense whatever the config's default
  # The eval's search split, its parts within its seconds (compiles are within the parts).
  searched = figures["search_split"]
  assert searched == open_eval["search_split"]
  parts_s = [searched[f"{p}_seconds"] for p in ("encode_wait", "hits", "units", "scoring")]
  assert all(x >= 0 for x in parts_s) and searched["units_seconds"] > 0
  assert sum(parts_s) <= open_eval["search_seconds"]
  assert 0 <= searched["compile_seconds"] <= open_eval["search_seconds"]
  assert searched["compiles"] >= 0
  hybrid = json.loads((work / "default" / "open_eval_Flat_hybrid.json").read_text())
  for key in ("em@1", "top1", "top20"):
    assert figures[f"hybrid_{key}"] == hybrid[key]
  assert hybrid["hybrid"]["weight_tuning"]["questions"] == 12
  manifest = json.loads((work / "default" / "dump" / "manifest.json").read_text())
  assert figures["dump_stored_tokens_per_s"] == manifest["num_tokens"] / manifest["seconds"]
  assert figures["dump_cold_tokens_per_s"] < figures["dump_stored_tokens_per_s"]
  warm = json.loads((work / "default" / "dump_warm" / "manifest.json").read_text())
  assert figures["dump_warm_tokens_per_s"] == warm["num_tokens"] / warm["seconds"]
  # The dumps' host parts are their manifests' (`dpjax.index.dump._host_times`).
  dump = result["candidates"]["default"]["dump"]
  for key in ("encoder_wait_seconds", "pipeline_wait_seconds", "write_wait_seconds",
              "dispatch_seconds", "fetch_seconds", "host_seconds", "compile_ahead_seconds"):
    assert dump[key] == manifest[key] and result["speed"]["dump_warm"][key] == warm[key], key
  assert figures["step_ms"] == 1e3 * result["speed"]["step"]["median_step_s"] > 0
  assert result["candidates"]["default"]["recipe"]["train.batch_size"] == 8
  assert result["command"].startswith("python experiments/gpu_check.py --workdir ")
  assert [t["figure"] for t in result["targets"]] == [k for k, _, _ in gpu_check.TARGETS]
  # Every target is judged but MFU: a CPU has no bf16 peak in the table.
  assert all(isinstance(t["met"], bool) == (t["figure"] != "step_mfu")
             for t in result["targets"])
  # The training's wall split is its timing record's, and sums to at most the stage's wall.
  timing = [json.loads(line) for line in (work / "default" / "metrics.jsonl").read_text()
            .splitlines() if '"timing"' in line][-1]
  parts = {p: figures[f"train_{p}_s"] for p in gpu_check.TRAIN_PARTS}
  assert parts == {p: timing.get(f"{p}_s", 0.0) for p in gpu_check.TRAIN_PARTS}
  assert all(parts[p] > 0 for p in ("setup", "data", "compiles", "steps", "rc_eval"))
  assert sum(parts.values()) <= result["stages"]["default.train"]["wall_s"]
  assert timing["steps_run"] == figures["steps"] == 6 and timing["compiles"] > 0
  assert figures["train_rc_compiled_ahead"] == timing["rc_compiled_ahead"] == 0  # a CPU's way
  assert figures["train_encoded"]["windows"] == 6 * 8  # tiny: 6 steps of 8 windows
  # Each timing stage's model FLOPs; no MFU without a peak.
  assert result["peak"]["per_device"] is None and "MFU not computed" in result["peak"]["note"]
  for stage in ("train", "dump", "dump_cold", "dump_warm", "eval", "hybrid_eval", "step"):
    assert figures[f"{stage}_flops"] > 0 and figures[f"{stage}_mfu"] is None, stage
  step = result["speed"]["step"]  # MiniLM, 8 windows of 32 tokens, 8 questions of 8
  assert figures["step_flops"] == gpu_check.train_step_flops(MINILM, 8, 32, 8, 8)
  assert figures["step_flops_per_s"] == figures["step_flops"] / step["median_step_s"]
  assert figures["dump_warm_flops"] == gpu_check.encoder_flops(
      result["candidates"]["default"]["model"], warm["num_windows"],
      warm["encoded_tokens"] / warm["num_windows"])

  rendered = tmp_path / "results" / "gpu_check.json"
  history = tmp_path / "results" / "gpu_runs.jsonl"
  argv = [str(out / "gpu_check.json"), "--out", str(rendered), "--history", str(history),
          "--note", "a note"]
  for _ in range(2):  # rendering the same run again appends no second history line
    assert report.gpu_check_report(argv) == 0
  markdown = rendered.with_suffix(".md").read_text()
  assert f"| passage Top-1 | {open_eval['top1']:.2f} |" in markdown
  assert "| eval: run alongside the hybrid search | True |" in markdown
  assert (f"| XLA autotuning results cached at the start (fusions) | "
          f"{report.cell(result['autotuned_at_start'])} |") in markdown
  split = " / ".join(report.cell(parts[p]) for p in ("data", "compiles", "steps", "rc_eval"))
  assert (f"| training's wall (s): data / compiles / steps / RC eval (their sum of the wall) | "
          f"{split} (") in markdown
  assert f"| bf16 step, XLA attention | {figures['step_flops']:.3g} | the median step |" in markdown
  assert (f"of the search's seconds (compiles within them) | "
          f"{report.cell(searched['encode_wait_seconds'])} / "
          f"{report.cell(searched['hits_seconds'])} / {report.cell(searched['units_seconds'])} / "
          f"{report.cell(searched['scoring_seconds'])} of "
          f"{report.cell(open_eval['search_seconds'])} (compiles: {searched['compiles']}, "
          ) in markdown
  c = report.cell
  for label, d in (("dump", manifest), ("warm dump", warm)):
    assert (f"| {label}'s seconds: encoder wait / compiles / host (of it: pipeline wait "
            f"[of that, the writes' drain], dispatch, fetch) of its seconds | "
            f"{c(d['encoder_wait_seconds'])} / ") in markdown
    assert (f" / {c(d['host_seconds'])} ({c(d['pipeline_wait_seconds'])} "
            f"[{c(d['write_wait_seconds'])}], "
            f"{c(d['dispatch_seconds'])}, {c(d['fetch_seconds'])}) of {c(d['seconds'])} |"
            ) in markdown
  step = result["speed"]["step"]
  assert step["packed"] is False and step["step_arrays"] > 300  # a CPU's way: every leaf apart
  assert (f"| bf16 step, XLA attention (ms): a step / back to back / its call's host time "
          f"(arrays passed, packed) | {c(1e3 * step['median_step_s'])} / "
          f"{c(1e3 * step['pipelined_step_s'])} / {c(1e3 * step['host_step_s'])} "
          f"({step['step_arrays']}, False) |") in markdown
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


def test_read_train_takes_the_timing_of_the_process_that_ran_steps(tmp_path):
  """A run found finished writes a timing record of no steps: the wall split stays the one of
  the process that trained."""
  lines = [{"split": "timing", "step": 6, "steps_run": 6, "data_s": 1.0, "steps_s": 5.0,
            "compiles": 3, "encoded": {"windows": 48}},
           {"split": "timing", "step": 6, "steps_run": 0, "setup_s": 2.0, "compiles": 0}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  found = gpu_check.read_train(tmp_path, 8)
  assert (found["train_data_s"], found["train_steps_s"], found["train_setup_s"]) == (1.0, 5.0, 0.0)
  assert found["train_steps_run"] == 6 and found["train_encoded"] == {"windows": 48}


def test_model_flops_against_a_hand_count():
  """An odd-sized encoder (d 6, f 10, 2 layers) counted by hand: a token through a layer's
  weights 2 (4*36 + 2*6*10) = 528 FLOPs, a row's attention over 5 keys 4*6*5 = 120."""
  model = {"hidden_size": 6, "intermediate_size": 10, "num_hidden_layers": 2}
  assert gpu_check.encoder_flops(model, 3, 5) == 3 * 2 * 5 * (528 + 120) == 19440
  # forward and backward: PaLM's 6 N T + 12 L d T^2 a sequence (N = 2 * 264 weights)
  assert gpu_check.encoder_flops(model, 3, 5, backward=True) == 3 * (6 * 528 * 5 + 12 * 2 * 6 * 25)
  # [CLS] only in the last layer: keys and values of 5 tokens 2*2*36*5 = 720, the query,
  # output and feed-forward of one row 2 (2*36 + 2*6*10) = 384, its attention 120.
  question = 5 * (528 + 120) + 720 + 384 + 120
  assert gpu_check.encoder_flops(model, 1, 5, first_only=True) == question == 4464
  assert gpu_check.question_flops(model, 3, 5) == 2 * 3 * question
  assert gpu_check.train_step_flops(model, 3, 5, 2, 5) == 3 * 19440 + 2 * 3 * 2 * question


def test_mfu_against_the_peak_table():
  h100 = gpu_check.peak_flops("gpu NVIDIA H100 80GB HBM3 2")
  assert h100 == {"per_device": 989.4e12, "devices": 2}
  assert gpu_check.mfu(989.4e12, 2.0, h100) == 0.25
  assert gpu_check.peak_flops("gpu NVIDIA H100 PCIe 1")["per_device"] == 756e12
  assert gpu_check.peak_flops("gpu NVIDIA A100-SXM4-80GB 8")["per_device"] == 312e12
  assert gpu_check.peak_flops("gpu NVIDIA H200 1")["per_device"] == 989.4e12
  for unknown in ("cpu cpu 8", "gpu NVIDIA H200 NVL 1"):  # no peak known: no MFU, a note
    peak = gpu_check.peak_flops(unknown)
    assert peak["per_device"] is None and "MFU not computed" in peak["note"]
    assert gpu_check.mfu(1e12, 1.0, peak) is None


def test_autotuned_counts_the_results_in_the_compilation_cache(tmp_path, monkeypatch):
  """The autotuning results an earlier run left in the cache folder gpu_check.sh names; none
  when the cache is off."""
  before = jax.config.jax_compilation_cache_dir  # (a run.py main in this process sets it)
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    _count_autotuned(tmp_path, monkeypatch)
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


def _count_autotuned(tmp_path, monkeypatch):
  monkeypatch.setenv("DPJAX_COMPILATION_CACHE", str(tmp_path))
  assert gpu_check.autotuned() == 0
  folder = tmp_path / "xla_gpu_per_fusion_autotune_cache_dir" / "ab"
  folder.mkdir(parents=True)
  for name in ("one.textproto", "two.textproto"):
    (folder / name).write_text("result")
  assert gpu_check.autotuned() == 2
  monkeypatch.setenv("DPJAX_COMPILATION_CACHE", "off")
  assert gpu_check.autotuned() is None


@pytest.mark.slow
def test_teacher_trained_first_then_the_candidate_distilled(tmp_path):
  """--teacher: the candidate's teacher is trained (its logits written) before the candidate,
  which then trains on them; the teacher's RC EM is its results.json's, in the report."""
  out, work = tmp_path / "out", tmp_path / "w"
  assert gpu_check.main(["--workdir", str(work), "--out", str(out), *TINY, "--teacher",
                         "default", "--stages", "train"]) == 0
  result = json.loads((out / "gpu_check.json").read_text())
  assert list(result["stages"]) == ["default.teacher", "default.train"]
  assert {v["rc"] for v in result["stages"].values()} == {0}
  teacher = json.loads((work / "default" / "teacher" / "results.json").read_text())
  found = result["candidates"]["default"]["teacher"]
  assert found["teacher_rc_exact_match"] == teacher["rc_exact_match"]
  logged = [json.loads(line) for line in (work / "default" / "metrics.jsonl").read_text()
            .splitlines()]
  assert any("distill" in r for r in logged if r.get("split") == "train")
  assert result["candidates"]["default"]["recipe"]["train.teacher_logits"] == "teacher/logits"
  markdown = report.render_gpu_check(result, "c")
  assert f"| teacher's RC EM | {report.cell(teacher['rc_exact_match'])} |" in markdown


def test_teacher_of_no_candidate_is_refused(tmp_path):
  with pytest.raises(SystemExit, match="not a candidate"):
    gpu_check.main(["--workdir", str(tmp_path), "--out", str(tmp_path), *TINY, "--teacher",
                    "nobody", "--stages", "train"])
