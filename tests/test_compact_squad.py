"""The SQuAD-open compact study (experiments/benchmarks/compact_squad.py): what it counts as the
served bytes, which eval reports it reuses, and the section it renders into results/scale.md."""
import json

from conftest import load_script

study = load_script("experiments/benchmarks/compact_squad.py")
scale = load_script("experiments/benchmarks/scale.py")


def _dump(tmp_path, tokens=1000):
  dump = tmp_path / "dump"
  (dump / "indexes" / "compact_SQ8" / "sub").mkdir(parents=True)
  (dump / "indexes" / "bm25").mkdir()
  (dump / "indexes" / "Flat").mkdir()
  (dump / "manifest.json").write_text(json.dumps({"num_tokens": tokens, "complete": True}))
  (dump / "indexes" / "compact_SQ8" / "codes.npy").write_bytes(b"x" * 3000)
  (dump / "indexes" / "compact_SQ8" / "sub" / "part").write_bytes(b"x" * 500)
  (dump / "indexes" / "bm25" / "data.npy").write_bytes(b"x" * 2000)
  (dump / "indexes" / "Flat" / "index.faiss").write_bytes(b"x" * 99999)  # not read: not counted
  return dump


def test_served_bytes_count_both_index_folders_and_the_manifest_only(tmp_path, monkeypatch):
  dump = _dump(tmp_path)
  monkeypatch.setattr("dpjax.index.manifest.read_manifest",
                      lambda d: json.loads((d / "manifest.json").read_text()))
  served = study.served_bytes(dump, "compact_SQ8")
  manifest = (dump / "manifest.json").stat().st_size
  assert served["bytes"] == {"compact_SQ8/codes.npy": 3000, "compact_SQ8/sub/part": 500,
                             "bm25/data.npy": 2000, "dump manifest": manifest}
  assert abs(served["total_per_token"] - (5500 + manifest) / 1000) < 1e-9


def test_only_an_eval_of_every_question_is_reused(tmp_path):
  path = tmp_path / "open_eval_Flat.json"
  hits = {"em@1": "10" * 5, "top1": "1" * 10, "top20": "0" * 10}
  path.write_text(json.dumps({"questions": 10, "hits": hits}))
  assert study._complete(path, 10)
  assert not study._complete(path, 12)  # an eval.limit run: not the study's questions
  path.write_text(json.dumps({"questions": 10, "hits": {**hits, "top20": "0" * 9}}))
  assert not study._complete(path, 10)


def _section(total_bytes: int) -> dict:
  row = {"em@1": 30.0, "top1": 60.0, "index_tokens": 7, "questions_per_s_eval": 20.0}
  return {"command": "python x", "commit": "a" * 40, "model_step": 2000, "config": "c",
          "codec": "OPQ24,PQ24", "filter_threshold": -3.3, "questions": 10,
          "rows": {"Flat, hybrid": row, "compact OPQ24,PQ24, hybrid": row},
          "paired": {"compact OPQ24,PQ24, hybrid vs Flat, hybrid": {"em@1": [3, 4, 1.0]}},
          "speed": {}, "bytes_budget": 16.0, "notes": [],
          "served_bytes": {"corpus_tokens": 1000, "bytes": {"a": total_bytes},
                           "per_token": {"a": total_bytes / 1000},
                           "total_per_token": total_bytes / 1000}}


def test_the_section_states_the_bounds_met_or_not():
  met = scale.squad_section(_section(15_000))
  assert "15.00 (bound 16: met)" in met and "45.0 GB** on disk (bound 48 GB: met)" in met
  missed = scale.squad_section(_section(17_000))
  assert "17.00 (bound 16: **not met**)" in missed
  assert "51.0 GB** on disk (bound 48 GB: **not met**)" in missed
  assert "em@1 3 / 4, p = 1" in met
