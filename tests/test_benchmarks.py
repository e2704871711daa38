"""The peers benchmark script runs end to end on the tiny pipeline."""
import importlib.util
import json

from conftest import REPO

import run


def _load(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / "benchmarks" /
                                                f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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
