"""The scale study (experiments/benchmarks/scale.py): its corpus, its fits, and a run end to end
at two tiny sizes."""
import argparse
import json
import os
import sys

import numpy as np
import pytest

from conftest import load_script

from dpjax.data import Tokenizer
from dpjax.data.corpus import read_corpus
from dpjax.data.questions import read_questions

scale = load_script("experiments/benchmarks/scale.py")


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_pretrained("minilm-l6")


def test_corpus_is_deterministic_with_its_answers_in_it(tokenizer, tmp_path):
  maker = scale.CorpusMaker(tokenizer, seed=3)
  record = scale.write_corpus(tmp_path, 7_919, maker, tokenizer, questions=11)
  lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
  again = scale.CorpusMaker(tokenizer, seed=3)
  assert [json.loads(line) for line in lines] == [again.passage(i) for i in range(len(lines))]
  assert scale.CorpusMaker(tokenizer, seed=4).passage(0) != again.passage(0)
  passages = list(read_corpus(tmp_path / "corpus.jsonl"))  # the dump's reader takes every one
  assert len(passages) == record["passages"] == len(lines)
  stored = sum(len(ids) for ids, _ in tokenizer.tokenize([p.text for p in passages]))
  assert abs(stored - 7_919) < 0.2 * 7_919
  assert 100 <= stored / len(passages) <= 160  # Wikipedia-like paragraphs
  questions = read_questions(tmp_path / "questions.jsonl")
  texts = {int(p.id[1:]): p.text for p in passages}
  assert len(questions) == 11
  for q in questions:
    assert q.answers[0] in texts[int(q.id[1:])]
  # Written once: the same request reuses the corpus.
  written = (tmp_path / "corpus.jsonl").stat().st_mtime_ns
  assert scale.write_corpus(tmp_path, 7_919, maker, tokenizer, questions=11) == record
  assert (tmp_path / "corpus.jsonl").stat().st_mtime_ns == written


def test_linear_fit_and_one_point():
  assert scale.linear_fit([1e6, 2e6, 4e6], [3 + 2e6 * 5, 3 + 4e6 * 5, 3 + 8e6 * 5]) == \
      pytest.approx((3.0, 10.0), rel=1e-6)
  assert scale.linear_fit([2e6], [8e6]) == (0.0, 4.0)


def test_a_search_time_that_falls_with_size_is_projected_flat():
  def row(tokens, qps):
    return {"tokens": tokens, "dim": 8, "search": {"batch1": {"questions_per_s": qps},
                                                   "batch64": {"questions_per_s": 2 * qps}},
            "bytes_per_token": {"dump_total": 1.0, "compact_total": 1.0, "served": 1.0},
            "dump": {}, "index": {"compact:SQ8": {"build_s": tokens / 1e3}}}
  args = argparse.Namespace(project_tokens=3e9, project_dim=8, spec="compact:SQ8",
                            encode_rate=1e5, encode_rate_source="given")
  # 100 then 125 questions/s: the slope is noise; the projection is their mean time, flat
  flat = scale.projection([row(1e4, 100.0), row(2e4, 125.0)], args)["questions_per_s_batch1"]
  assert flat["flat"] and flat["seconds_per_question_per_token"] == 0.0
  assert flat["projected"] == pytest.approx(1 / ((1 / 100 + 1 / 125) / 2))
  grows = scale.projection([row(1e4, 125.0), row(2e4, 100.0)], args)["questions_per_s_batch1"]
  assert not grows["flat"] and 0 < grows["projected"] < 100


def test_memory_that_falls_with_size_is_projected_at_the_largest_measured():
  def row(tokens, peak):
    return {"tokens": tokens, "dim": 8, "search": {"batch1": {"questions_per_s": 100.0},
                                                   "batch64": {"questions_per_s": 200.0}},
            "bytes_per_token": {"dump_total": 1.0, "compact_total": 1.0, "served": 1.0},
            "dump": {"peak_rss_bytes": peak}, "index": {"compact:SQ8": {"build_s": 1.0}}}
  args = argparse.Namespace(project_tokens=3e9, project_dim=8, spec="compact:SQ8",
                            encode_rate=1e5, encode_rate_source="given")
  fell = scale.projection([row(1e4, 2e9), row(2e4, 1.9e9)], args)["dump_peak_rss_bytes"]
  assert fell == {"intercept": 2e9, "per_token": 0.0, "projected": 2e9, "flat": True}
  grew = scale.projection([row(1e4, 1.9e9), row(2e4, 2e9)], args)["dump_peak_rss_bytes"]
  assert "flat" not in grew and grew["projected"] > 2e9


@pytest.mark.slow
def test_two_tiny_sizes_end_to_end(tmp_path, monkeypatch):
  """Dump, compact index, serve and search at 20k and 40k tokens (~30 s on one core)."""
  monkeypatch.setenv("XLA_FLAGS", "")  # run.py's children: one CPU device, quicker to start
  out = tmp_path / "scale.json"
  args = ["--root", str(tmp_path / "root"), "--sizes", "20000", "40000", "--spec",
          "compact:SQ8", "--questions", "64", "--batch1", "8", "--batches64", "1",
          "--set", "serve.max_batch=1", "--encode-rate", "1e5", "--out", str(out),
          "--note", "a note"]
  assert scale.main(args) == 0
  results = json.loads(out.read_text())
  rows = results["rows"]
  assert [r["tokens_requested"] for r in rows] == [20000, 40000]
  for row in rows:
    assert abs(row["tokens"] - row["tokens_requested"]) < 0.2 * row["tokens_requested"]
    assert row["dump"]["wall_s"] > 0 and row["dump"]["peak_rss_bytes"] > 0
    index = row["index"]["compact:SQ8"]
    assert index["wall_s"] > 0 and index["peak_rss_bytes"] > 0
    per = row["bytes_per_token"]
    assert per["dump"]["vectors.npy"] == pytest.approx(2 * row["dim"], rel=0.01)
    assert per["compact"]["codes.npy"] == pytest.approx(row["dim"], rel=0.01)  # SQ8: a byte
    assert per["served"] > per["compact_total"] > 0
    assert row["serve"]["vmrss_bytes"] > 0 and row["serve"]["exit"] == 0
    for batch in ("batch1", "batch64"):
      assert row["search"][batch]["questions_per_s"] > 0
      assert row["search"][batch]["p50_ms"] > 0
    assert row["search"]["mapped_vs_loaded"]["identical"]
  projected = results["projection"]
  assert projected["tokens"] == 3e9
  assert projected["disk_bytes"]["compact_index"] > 0
  assert projected["hours"]["dump"] == pytest.approx(3e9 / 1e5 / 3600)
  assert projected["questions_per_s_batch64"]["projected"] > 0
  report = out.with_suffix(".md").read_text()
  assert f"| {rows[1]['tokens']:,} |" in report and "Projected to 3.0e+09" in report
  assert "a note" in report and "--note ..." in report
  # Run again: both sizes come from the results file, nothing is measured again.
  stages = (tmp_path / "root" / "tokens_20000" / "stages.json").read_text()
  monkeypatch.setattr(scale, "measure_size", lambda *a: pytest.fail("measured again"))
  assert scale.main(args) == 0
  assert json.loads(out.read_text())["rows"] == rows
  assert (tmp_path / "root" / "tokens_20000" / "stages.json").read_text() == stages


@pytest.mark.skipif(not os.access(scale.TIME, os.X_OK), reason="no GNU time here")
def test_a_stage_peak_is_the_commands_not_this_processs(tmp_path):
  """A child forked from a big process would report that process's peak as its own."""
  ballast = np.ones(64 << 20)  # 512 MiB touched in this process
  run = scale.timed_run([sys.executable, "-c", "import numpy; numpy.ones(1 << 24)"],
                        tmp_path / "small.log")  # ~128 MiB in the child
  assert run["peak_rss_source"] == "GNU time %M"
  assert 128 << 20 < run["peak_rss_bytes"] < 400 << 20, run
  assert ballast.sum() > 0
