"""The peers benchmark script runs end to end on the tiny pipeline."""
import json

import pytest

from conftest import REPO, load_script

import run


def _load(name):
  return load_script(f"experiments/benchmarks/{name}.py")


def test_passage_retrieval_benchmark_tiny(tmp_path, monkeypatch):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  for mode in ("train", "dump"):
    assert run.main([mode] + base) == 0
  assert run.main(["index"] + base + ["--set", "index.specs=['Flat','IVFauto,SQ8']"]) == 0
  monkeypatch.chdir(REPO)
  out = tmp_path / "peers.json"
  assert _load("passage_retrieval").main(base + ["--indexes", "Flat", "IVFauto_SQ8", "--out",
                                                 str(out)]) == 0
  results = json.loads(out.read_text())
  assert set(results["systems"]) == {"dpjax-Flat", "dpjax-IVFauto_SQ8", "bm25", "dense-minilm"}
  for system in results["systems"].values():
    s = system["scores"]
    assert 0 <= s["top1"] <= s["top5"] <= s["top20"] <= s["top100"] <= 100
  # The synthetic questions name their entity: BM25 finds the passage.
  assert results["systems"]["bm25"]["scores"]["top5"] >= 50
  assert "| bm25 |" in out.with_suffix(".md").read_text()
  # A later run (e.g. a newer model) measures dpjax-Flat again and keeps the earlier peers.
  again = tmp_path / "again.json"
  assert _load("passage_retrieval").main(base + ["--systems", "dpjax", "--indexes", "Flat",
                                                 "--merge", str(out), "--out", str(again)]) == 0
  merged = json.loads(again.read_text())
  assert list(merged["systems"]) == ["dpjax-Flat", "dpjax-IVFauto_SQ8", "bm25", "dense-minilm"]
  first, second = merged["commands"]
  assert "--merge" not in first and "--merge" in second
  assert [s["command"] for s in merged["systems"].values()] == [second, first, first, first]
  assert merged["systems"]["bm25"] == {**results["systems"]["bm25"], "command": first}
  assert "command 2, `" in again.with_suffix(".md").read_text()
  # Hybrid search (the config's index.sparse) is its own row; at weight 0 it ranks as dense.
  assert run.main(["index"] + base + ["--set", "index.sparse=True", "--set", "index.specs=[]",
                                      "--set", "index.sparse_tune_questions=20"]) == 0
  hybrid = tmp_path / "hybrid.json"
  for weight in ("None", "0.0"):
    assert _load("passage_retrieval").main(base + [
        "--systems", "dpjax", "--indexes", "Flat", "--set", "index.sparse=True", "--set",
        f"index.sparse_weight={weight}", "--out", str(hybrid)]) == 0
    row = json.loads(hybrid.read_text())["systems"]["dpjax-Flat-hybrid"]
    if weight == "0.0":
      assert row["scores"] == merged["systems"]["dpjax-Flat"]["scores"]
      assert row["em@1"] == merged["systems"]["dpjax-Flat"]["em@1"]
  # Merging only (no systems measured): a system in several tables comes from the last one.
  only = tmp_path / "only.json"
  assert _load("passage_retrieval").main(base + ["--systems", "--merge", str(again), str(out),
                                                 "--out", str(only)]) == 0
  combined = json.loads(only.read_text())
  assert combined["systems"]["dpjax-Flat"]["command"] == first and "merged_by" in combined
  # A table of other questions is refused, naming it.
  with pytest.raises(SystemExit, match="again.json has .* questions.*mix two setups"):
    _load("passage_retrieval").main(base + ["--systems", "bm25", "--set", "eval.limit=3",
                                            "--merge", str(again), "--out", str(only)])
  # So is one of as many, but other, questions (its fingerprint differs).
  other = json.loads(again.read_text())
  other["fingerprint"] = "0" * 16
  (tmp_path / "other.json").write_text(json.dumps(other))
  with pytest.raises(SystemExit, match="other.json has .*fingerprint 0+\\).*mix two setups"):
    _load("passage_retrieval").main(base + ["--systems", "--merge", str(tmp_path / "other.json"),
                                            "--out", str(only)])
  # And one whose passages were matched to answers before has_answer became DPR's.
  old = json.loads(again.read_text())
  del old["answer_match"]
  (tmp_path / "old.json").write_text(json.dumps(old))
  with pytest.raises(SystemExit, match="old.json: its rows matched passages to answers the old"):
    _load("passage_retrieval").main(base + ["--systems", "--merge", str(tmp_path / "old.json"),
                                            "--out", str(only)])
  assert "SQuAD-normalised" not in only.with_suffix(".md").read_text()


def test_search_scale_benchmark_tiny(tmp_path, monkeypatch):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  for mode in ("train", "dump"):
    assert run.main([mode] + base) == 0
  monkeypatch.chdir(REPO)
  out = tmp_path / "scale.json"
  assert _load("search_scale").main(base + [
      "--sizes", "3000", "9000", "--specs", "Flat", "IVFauto,SQ8", "OPQ6,IVFauto,PQ6x4",
      "--questions", "64", "--recall-queries", "16", "--max-gb", "1", "--out", str(out),
      "--set", "index.train_size=4000"]) == 0
  results = json.loads(out.read_text())
  rows = {(r["size"], r["spec"]): r for r in results["rows"]}
  assert len(rows) == 6 and not any("skipped" in r for r in rows.values())
  for size in (3000, 9000):
    assert rows[(size, "Flat")]["recall_at_10"] == 1.0  # exact search finds the exact top-10
    assert rows[(size, "Flat")]["bytes_per_token"] > rows[(size, "IVFauto,SQ8")]["bytes_per_token"]
  for r in rows.values():
    assert r["batch64"]["questions_per_sec"] > 0 and r["batch1"]["p99_ms"] >= r["batch1"]["p50_ms"]
  assert set(results["extrapolation"]) == {"Flat", "IVFauto,SQ8", "OPQ6,IVFauto,PQ6x4"}
  assert out.with_suffix(".png").is_file()
  assert "English Wikipedia" in out.with_suffix(".md").read_text()
  # A memory limit below what Flat needs skips it, and says so.
  assert _load("search_scale").main(base + [
      "--sizes", "3000", "--specs", "Flat", "--questions", "8", "--recall-queries", "4",
      "--max-gb", "0.00001", "--out", str(tmp_path / "skip.json")]) == 0
  skipped = json.loads((tmp_path / "skip.json").read_text())["rows"][0]
  assert "skipped" in skipped and "GiB" in skipped["skipped"]
  # So does a build time limit, estimated from the smaller size's build.
  assert _load("search_scale").main(base + [
      "--sizes", "3000", "9000", "--specs", "Flat", "--questions", "8", "--recall-queries", "4",
      "--max-build-minutes", "1e-9", "--out", str(tmp_path / "slow.json")]) == 0
  small, large = json.loads((tmp_path / "slow.json").read_text())["rows"]
  assert "skipped" not in small and "estimated" in large["skipped"]
  # A later run measures the skipped row and merges it into the table.
  assert _load("search_scale").main(base + [
      "--sizes", "9000", "--specs", "Flat", "--questions", "8", "--recall-queries", "4",
      "--merge", "--out", str(tmp_path / "slow.json")]) == 0
  merged = json.loads((tmp_path / "slow.json").read_text())
  assert [(r["size"], "skipped" in r) for r in merged["rows"]] == [(3000, False), (9000, False)]
  assert merged["rows"][0] == small and len(merged["commands"]) == 2
  # Tables of two runs (e.g. one per core) are combined into a third: a measured row replaces
  # another table's skipped one, and nothing is measured again.
  combined = tmp_path / "combined.json"
  assert _load("search_scale").main(base + [
      "--sizes", "3000", "9000", "--specs", "Flat", "--questions", "8", "--recall-queries", "4",
      "--merge", str(tmp_path / "skip.json"), str(tmp_path / "slow.json"),
      "--out", str(combined)]) == 0
  together = json.loads(combined.read_text())
  assert together["rows"] == merged["rows"]
  assert together["commands"][:-1] == (json.loads((tmp_path / "skip.json").read_text())["commands"]
                                       + merged["commands"]) and len(together["commands"]) == 4
  # The same row measured in two tables is refused; so is a table that does not exist.
  with pytest.raises(SystemExit, match="measured in both"):
    _load("search_scale").main(base + ["--sizes", "3000", "--specs", "Flat", "--merge",
                                       str(tmp_path / "slow.json"), str(combined),
                                       "--out", str(tmp_path / "twice.json")])
  with pytest.raises(SystemExit, match="no such table.*absent.json"):
    _load("search_scale").main(base + ["--sizes", "3000", "--specs", "Flat", "--merge",
                                       str(tmp_path / "absent.json"), "--out", str(combined)])
  # Merging a table of another setup (here: other noise) is refused, naming the file.
  with pytest.raises(SystemExit, match="slow.json.*mix two setups"):
    _load("search_scale").main(base + ["--sizes", "3000", "--specs", "Flat", "--noise", "0.1",
                                       "--merge", "--out", str(tmp_path / "slow.json")])


def test_encode_speed_benchmark_tiny(tmp_path, monkeypatch):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(["train"] + base) == 0
  monkeypatch.chdir(REPO)
  out = tmp_path / "speed.json"
  from dpjax import parallel
  before = parallel.map_batches
  assert _load("encode_speed").main(base + ["--questions", "4", "--passages", "12",
                                            "--repeats", "2", "--out", str(out)]) == 0
  assert parallel.map_batches is before  # the padded stand-in is gone again
  results = json.loads(out.read_text())
  q, d = results["question"], results["dump"]
  assert q["bucketed_ms"] > 0 and q["padded_ms"] > 0 and q["questions"] == 4
  assert d["tokens"] > 0 and d["bucketed_tokens_per_s"] > 0 and d["padded_tokens_per_s"] > 0
  assert d["max_abs_diff"] < 1e-2  # bucketing changes no vector
  assert "| dump encoding" in out.with_suffix(".md").read_text()


def test_dump_host_benchmark_tiny(tmp_path, monkeypatch):
  """The dump's pipeline with an encoder that computes nothing stores the tokens the real dump
  of the same passages stores, its split within its seconds; the modules' functions it replaced
  are back afterwards."""
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path / "w")]
  assert run.main(["train"] + base) == 0
  monkeypatch.chdir(REPO)
  from dpjax.index import dump as dump_module
  from dpjax.models import encoders
  kept = encoders._on_cpu, dump_module.bound
  out = tmp_path / "host.json"
  assert _load("dump_host").main(base + ["--passages", "1000", "--repeats", "2", "--scratch",
                                         str(tmp_path / "s"), "--out", str(out)]) == 0
  assert (encoders._on_cpu, dump_module.bound) == kept
  assert run.main(["dump"] + base) == 0
  real = json.loads((tmp_path / "w" / "dump" / "manifest.json").read_text())
  results = json.loads(out.read_text())
  assert results["passages"] == real["num_passages"] > 1  # the whole corpus
  assert len(results["runs"]) == 2 and all(r["num_tokens"] == real["num_tokens"] > 0
                                           for r in results["runs"])
  for r in results["runs"]:
    assert r["encoder_wait_seconds"] + r["host_seconds"] <= r["seconds"] <= r["wall_seconds"]
    assert r["write_wait_seconds"] <= r["pipeline_wait_seconds"] <= r["host_seconds"]
  assert "| stored_tokens_per_s |" in out.with_suffix(".md").read_text()
  # Against a tree (here this one again): a process of each in turn, the ratio pair by pair.
  vs = tmp_path / "vs.json"
  assert _load("dump_host").main(base + ["--passages", "1000", "--repeats", "1", "--scratch",
                                         str(tmp_path / "s"), "--vs", str(REPO), "--pairs",
                                         "1", "--out", str(vs)]) == 0
  both = json.loads(vs.read_text())
  trees = both["versus"]["trees"]
  assert [len(trees[t]["runs"]) for t in ("this", "other")] == [1, 1]
  assert both["runs"] == trees["this"]["runs"] and both["num_tokens"] == real["num_tokens"]
  rates = [trees[t]["median"]["stored_tokens_per_s"] for t in ("this", "other")]
  assert both["versus"]["ratios"] == [pytest.approx(rates[0] / rates[1])]


def test_eval_cores_benchmark_tiny(tmp_path, monkeypatch, squad_dir):
  """The eval loop timed in two pinned child processes (one core, all cores): its dump and
  indexes made once in the scratch directory, the bound its one-core time implies."""
  if squad_dir.resolve() != (REPO / "../shared/data/squad").resolve():
    pytest.skip("speed.py's SQuAD questions are read from ../shared/data")
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path / "w")]
  assert run.main(["train"] + base) == 0
  monkeypatch.chdir(REPO)
  out = tmp_path / "cores.json"
  args = base + ["--scratch", str(tmp_path / "s"), "--passages", "6", "--questions", "8",
                 "--repeats", "1", "--out", str(out)]
  assert _load("eval_cores").main(args) == 0
  r = json.loads(out.read_text())
  assert (tmp_path / "s" / "dump" / "indexes" / "IVF_SQ4").is_dir()
  assert len(r["one_core"]["cores"]) == 1 and r["cores"] == len(r["all_cores"]["cores"])
  assert r["one_core"]["per_batch"]["encode"] > 0 and r["all_cores"]["per_batch"]["retrieve"] > 0
  assert r["bound_questions_per_s"] == pytest.approx(
      64 * r["cores"] / r["one_core"]["batch_seconds"])
  assert r["pipelined_questions_per_s"] == pytest.approx(
      64 / r["all_cores"]["pipelined_batch_seconds"])


def test_speed_dump_role_times_rounds_and_the_bare_forward_between_them(tmp_path, monkeypatch):
  """speed.py's dump role (the new tree's): a cold dump, then `--rounds` warm ones, each into a
  fresh directory (the last kept, complete), with `--repeats` bare forward calls timed after
  each; the reported times are the rounds' medians."""
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path / "w")]
  assert run.main(["train"] + base) == 0
  monkeypatch.chdir(REPO)
  speed = _load("speed")
  passages = [{"id": f"p{i}", "title": "T", "text": f"passage {i} " + "word " * (7 * i + 3)}
              for i in range(12)]
  (tmp_path / "passages.json").write_text(json.dumps(passages))
  result = tmp_path / "dump.json"
  assert speed.main(base + ["--role", "dump", "--tree", str(REPO), "--result", str(result),
                            "--passages-file", str(tmp_path / "passages.json"),
                            "--out-dir", str(tmp_path / "dump"), "--rounds", "3",
                            "--repeats", "2", "--bare", "1"]) == 0
  r = json.loads(result.read_text())
  assert len(r["rounds"]) == 3 and len(r["bare"]["seconds"]) == 3 * 2
  assert r["seconds"] == sorted(x["seconds"] for x in r["rounds"])[1]
  assert r["host_seconds"] == sorted(x["host_seconds"] for x in r["rounds"])[1]
  assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
  rows, width = r["bare"]["shape"]
  middle = sorted(r["bare"]["seconds"])[2:4]  # the median of 6 calls: the middle two's mean
  assert r["bare"]["tokens_per_s"] == pytest.approx(rows * width / (sum(middle) / 2))
  manifest = json.loads((tmp_path / "dump" / "manifest.json").read_text())
  assert manifest["complete"] and manifest["num_tokens"] == r["tokens"]


def test_report_command_line_is_runnable():
  """The command a report names re-parses to the arguments given; notes show as `--note ...`."""
  import shlex
  from experiments.report import command_line, elide_notes
  argv = ["--out", "results/a b.json", "--note", "prose; with $pecial chars", "--set", "x=['Flat']"]
  line = command_line("experiments/x.py", elide_notes(argv))
  assert line.startswith("python experiments/x.py ")
  assert "--note ..." in line and "prose" not in line
  words = shlex.split(line.replace("--note ...", ""))
  assert words == ["python", "experiments/x.py", "--out", "results/a b.json", "--set", "x=['Flat']"]


def test_speed_report_renders_every_figure():
  """speed.py's Markdown from a results dict shaped as `run_all` makes it: every figure of issue
  22 in the table (n/a where not measured, e.g. no PyTorch), the dump and eval lines."""
  speed = _load("speed")
  summary = {"dump_over_bare_forward": 0.79, "dump_new_over_old": 1.09,
             "dump_host_us_per_token": 2.14, "dump_host_cpu_us_per_token": 1.5,
             "dump_over_torch": None, "eval_new_over_old_flat": 2.35,
             "eval_new_over_old_ivf_sq4": 1.72, "train_step_over_torch": None}
  tree = {"tokens": 80000, "tokens_per_s": 5056.0, "shards": 1, "shard_passages": 2000,
          "compiles": 5, "compiles_warm": 0, "cold_seconds": 18.0}
  dump = {"new": tree, "old": {**tree, "tokens_per_s": 4636.0},
          "bare": {"tokens_per_s": 6416.0, "shape": [64, 192]}, "torch": None, "passages": 600,
          "vectors_max_abs_diff": 0.56, "vectors_mean_abs_diff": 0.0092, "min_context": 32}
  run = {"questions_per_s": 65.0, "em@1": 43.44, "top20": 97.58, "compiles_timed": 0}
  evaluation = {"Flat": {"old": run, "new": {**run, "questions_per_s": 152.8},
                         "same_passages": True}}
  results = {"summary": summary, "dump": dump, "eval": evaluation, "workdir": "w",
             "config": "c", "devices": "1 cpu", "old_commit": "a", "new_commit": "b",
             "notes": ["a note"]}
  text = speed.markdown(results, "python experiments/benchmarks/speed.py ...")
  for key, value in summary.items():
    assert f"| `{key}` | {'n/a' if value is None else f'{value:.2f}'} |" in text
  assert "new 5,056 tokens/s, old 4,636" in text and "PyTorch" not in text.split("Dump (")[1]
  assert "| Flat | new | 152.8 | 43.44 | 97.58 | 0 |" in text
  assert "Flat yes" in text and text.rstrip().endswith("a note")
  assert "waiting for the tokenizer's" not in text  # a dump without the split (an older tree)
  summary["dump_host_pipeline_us_per_token"] = dump["host_pipeline_us_per_token"] = 0.9
  dump["host_us_per_token"] = 2.14
  text = speed.markdown(results, "python experiments/benchmarks/speed.py ...")
  assert "| `dump_host_pipeline_us_per_token` | 0.90 |" in text
  assert ("Host time 2.14 us per stored token, of which 0.90 waiting for the tokenizer's and "
          "writer's threads") in text
  # --dump-dtype: the new dump in the model's dtype too, and what the dtype changes.
  summary["dump_new_model_dtype_over_old"] = 1.05
  dump.update(dtype="bfloat16", new_model_dtype={**tree, "tokens_per_s": 4870.0},
              dtype_max_abs_diff=0.31, dtype_mean_abs_diff=0.012)
  text = speed.markdown(results, "python experiments/benchmarks/speed.py ...")
  assert "| `dump_new_model_dtype_over_old` | 1.05 |" in text
  assert ("new 5,056 tokens/s (computing in bfloat16; new in the model's dtype 4,870, its vectors "
          "within max |diff| 0.31, mean 0.012 of the bfloat16 ones), old 4,636") in text


def test_attention_benchmark_checks_each_flash_setting(tmp_path):
  """The attention micro-benchmark's CPU smoke run: each flash setting agrees with the
  materialised path (same dropout masks) and is timed; one its sizes cannot take is reported as
  an error, not timed, and the others still run."""
  out = tmp_path / "attention.json"
  assert _load("attention").main(["--small", "--tunings", "32x32x4x2", "48x64x4x2",
                                  "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["shape"] == [2, 64, 2, 16] and result["xla_materialised"]["ms"] > 0
  good, bad = result["flash_32x32x4x2"], result["flash_48x64x4x2"]
  assert 0 < good["max_rel_diff"] < _load("attention").DISAGREES and good["ms"] > 0
  assert "block_q 48 must be a power of two >= 16 that divides 64" in bad["error"]
  assert "ms" not in bad
  assert result["best"] == "32x32x4x2"


def test_profile_summary_accounts_for_a_traced_program(tmp_path):
  """A trace of 3 calls of a jitted program on this CPU: its XLA operations (the host plane's,
  no device plane here), per call, each op's count and time, kinds summing to the ops' time, and
  the busy time (their intervals' union) within the traced window."""
  import jax
  import jax.numpy as jnp
  summary = _load("profile_summary")
  f = jax.jit(lambda x: jnp.tanh(x @ x) + 1.0)
  x = jnp.ones((256, 256))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path / "trace")):
    for _ in range(3):
      f(x).block_until_ready()
  s = summary.summarise(tmp_path / "trace", steps=3)
  assert s["plane"] == "/host:CPU" and s["device_planes"] == 0 and s["steps"] == 3
  assert s["operations"] >= 1 and sum(op["count"] for op in s["top"]) == s["operations"]
  ops_ms = sum(op["ms"] for op in s["top"])
  assert ops_ms > 0 and sum(s["kinds_ms"].values()) == pytest.approx(ops_ms, abs=1e-3)
  assert 0 < s["busy_ms"] <= ops_ms + 1e-3 and s["busy_ms"] <= s["window_ms"]
  assert s["idle_ms"] == pytest.approx(s["window_ms"] - s["busy_ms"], abs=1e-3)
  assert [op["ms"] for op in s["top"]] == sorted((op["ms"] for op in s["top"]), reverse=True)
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no \\*.xplane.pb under .*empty"):
    summary.summarise(tmp_path / "empty")
  # the GPU's kernel names (as an H100's traces name them) by kind
  assert [summary.kind_of(n) for n in (
      "dpjax_flash_backward_kv custom-call.3", "nvjet_tst_128x64_64x8_1x1_h_bz_TNN",
      "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm_fusion_dot.12",
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "loop_multiply_fusion.7",
      "input_reduce_fusion.2", "copy_fusion", "memset32")] == [
      "flash attention", "matmul", "matmul", "matmul", "cudnn attention", "fusion", "reduce",
      "copy/transpose", "other"]
