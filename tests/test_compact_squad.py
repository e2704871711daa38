"""The SQuAD-open compact study (experiments/benchmarks/compact_squad.py): what it counts as the
served bytes, which eval reports it reuses, and the section it renders into results/scale.md."""
import json

import pytest

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
  # a dump filtered as it was made: per corpus token, not per kept one
  (dump / "manifest.json").write_text(json.dumps({"num_tokens": 250, "context_tokens": 1000}))
  served = study.served_bytes(dump, "compact_SQ8")
  assert served["corpus_tokens"] == 1000


def test_only_an_eval_of_every_question_is_reused(tmp_path):
  path = tmp_path / "open_eval_Flat.json"
  hits = {"em@1": "10" * 5, "top1": "1" * 10, "top20": "0" * 10}
  path.write_text(json.dumps({"questions": 10, "hits": hits}))
  assert study._complete(path, 10)
  assert not study._complete(path, 12)  # an eval.limit run: not the study's questions
  path.write_text(json.dumps({"questions": 10, "hits": {**hits, "top20": "0" * 9}}))
  assert not study._complete(path, 10)
  # a hybrid report is reused only when its BM25 scored as this code's does
  from dpjax.index.sparse import SETTINGS
  for bm25, reused in ((SETTINGS, True), ({**SETTINGS, "sentences": "an earlier term"}, False)):
    path.write_text(json.dumps({"questions": 10, "hits": hits, "hybrid": {"bm25": bm25}}))
    assert study._complete(path, 10) is reused


def test_compact_rows_read_the_reports_of_their_own_overrides(tmp_path):
  args = study.parse(["--config", "experiments/squad.py:cpu", "--workdir", str(tmp_path),
                      "--codec", "OPQ24,PQ24", "--compact-set", "eval.checkpoint=qsft"])
  rows = study.systems(args, -2.9140625)
  names = {name: study.eval_file(args, overrides).name for name, (_, _, overrides) in rows.items()}
  folder = "compact_OPQ24_PQ24_filter-2.91406"
  assert names == {"Flat, dense": "open_eval_Flat.json",
                   "Flat, hybrid": "open_eval_Flat_hybrid.json",
                   "compact OPQ24,PQ24, dense": f"open_eval_{folder}_qsft.json",
                   "compact OPQ24,PQ24, hybrid": f"open_eval_{folder}_hybrid_qsft.json"}


def test_reread_rows_read_their_own_reports_and_timing_is_reused_only_for_them(tmp_path):
  args = study.parse(["--config", "experiments/squad.py:cpu", "--workdir", str(tmp_path),
                      "--codec", "OPQ24,PQ24", "--reread", "3", "--reread-set",
                      "index.sparse_weight=1", "--reread-dense", "10"])
  rows = study.systems(args, None)
  name = "compact OPQ24,PQ24, hybrid, reread 3"
  assert study.eval_file(args, rows[name][2]).name == (
      "open_eval_compact_OPQ24_PQ24_hybrid_reread3_w1_s0.json")
  assert study.eval_file(args, rows["compact OPQ24,PQ24, dense, reread 10"][2]).name == (
      "open_eval_compact_OPQ24_PQ24_reread10.json")
  margin = study.parse(["--config", "experiments/squad.py:cpu", "--workdir", str(tmp_path),
                        "--reread-margin", "3:2.5", "--reread-set", "index.sparse_weight=1"])
  within = study.systems(margin, None)["compact OPQ24,PQ24, hybrid, reread 3 within 2.5"][2]
  assert study.eval_file(margin, within).name == (
      "open_eval_compact_OPQ24_PQ24_hybrid_reread3_m2.5_w1_s0.json")
  with pytest.raises(SystemExit):
    study.parse(["--config", "c", "--workdir", "w", "--reread-margin", "3"])
  out = tmp_path / "scale.json"
  timing = {"commit": "c" * 40, "rows": {n: {} for n in rows if ", hybrid" in n}}
  out.write_text(json.dumps({"squad_open": {"speed": timing}}))
  assert study.reused_timing(out, study.timed_rows(args, rows)) == timing
  del rows[name]  # timed searches that are not these rows': timed again, not reused
  with pytest.raises(SystemExit, match="no timing of"):
    study.reused_timing(out, study.timed_rows(args, rows))


def test_a_window_reaches_the_hybrid_rereading_rows_and_dense_sets_the_dense_ones(tmp_path):
  args = study.parse(["--config", "experiments/squad.py:cpu", "--workdir", str(tmp_path),
                      "--reread-margin", "3:3", "--reread-dense", "20", "--window", "128",
                      "--reread-set", "index.sparse_weight=1",
                      "--reread-dense-set", "index.nprobe=2048", "--reread-dense", "10",
                      "--reread-dense-qsft"])
  files = {name: study.eval_file(args, overrides).name
           for name, (_, _, overrides) in study.systems(args, None).items()}
  assert {name: files.pop(name) for name in list(files) if "QSFT" in name} == {
      f"compact OPQ24,PQ24, dense, reread {r}, nprobe 2048, QSFT candidates":
          f"open_eval_compact_OPQ24_PQ24_reread{r}_scored_latest_nprobe2048_qsft.json"
      for r in (20, 10)}
  assert files == {
      "Flat, dense": "open_eval_Flat.json", "Flat, hybrid": "open_eval_Flat_hybrid.json",
      "compact OPQ24,PQ24, dense": "open_eval_compact_OPQ24_PQ24.json",
      "compact OPQ24,PQ24, hybrid": "open_eval_compact_OPQ24_PQ24_hybrid.json",
      "compact OPQ24,PQ24, hybrid, reread 3 within 3, window 128":
          "open_eval_compact_OPQ24_PQ24_hybrid_reread3_m3_around128_w1_s0.json",
      "compact OPQ24,PQ24, dense, reread 20, nprobe 2048":
          "open_eval_compact_OPQ24_PQ24_reread20_nprobe2048.json",
      "compact OPQ24,PQ24, dense, reread 10, nprobe 2048":
          "open_eval_compact_OPQ24_PQ24_reread10_nprobe2048.json"}


def test_versus_rows_read_the_other_indexs_reports_are_paired_and_not_timed(tmp_path,
                                                                           monkeypatch):
  args = study.parse(["--config", "experiments/squad.py:cpu", "--workdir", str(tmp_path),
                      "--codec", "qw+pr:RQ24x8", "--versus", "qw+pr:OPQ24,PQ24",
                      "--reread-margin", "3:3", "--reread-set", "index.sparse_weight=1"])
  rows = study.systems(args, -2.9140625)
  folder = "compact_qw_pr_OPQ24_PQ24_filter-2.91406"
  other = {name: study.eval_file(args, rows[name][2]).name for name in rows
           if name.startswith("compact qw+pr:OPQ24,PQ24,")}
  assert other == {"compact qw+pr:OPQ24,PQ24, dense": f"open_eval_{folder}.json",
                   "compact qw+pr:OPQ24,PQ24, hybrid": f"open_eval_{folder}_hybrid.json",
                   "compact qw+pr:OPQ24,PQ24, hybrid, reread 3 within 3":
                       f"open_eval_{folder}_hybrid_reread3_m3_w1_s0.json"}
  assert study.timed_rows(args, rows) == [
      "Flat, hybrid", "compact qw+pr:RQ24x8, hybrid", "compact qw+pr:RQ24x8, hybrid, reread 3 "
      "within 3"]
  hits = {k: "10" for k in study.PAIRED}
  reports = {name: {"em@1": 1.0, "index_tokens": 2, "model_step": 1, "questions": 2,
                    "search_seconds": 1.0, "questions_per_sec_batch64": 1.0, "hits": hits}
             for name in rows}
  monkeypatch.setattr(study, "served_bytes", lambda dump, folder: folder)
  section = study.summarise(args, -2.9140625, {"reports": reports, "commands": {}}, {}, rows)
  assert section["served_bytes"] == "compact_qw_pr_RQ24x8_filter-2.91406"
  kinds = ("dense", "hybrid", "hybrid, reread 3 within 3")
  assert set(section["paired"]) == {
      f"compact qw+pr:RQ24x8, {kind} vs compact qw+pr:OPQ24,PQ24, {kind}" for kind in kinds} | {
      f"compact qw+pr:RQ24x8, {kind} vs Flat, {kind.split(', ')[0]}" for kind in kinds}


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
  section = _section(15_000)
  section["rows"]["compact OPQ24,PQ24, hybrid"] = {
      **section["rows"]["Flat, hybrid"], "checkpoint": "qsft", "model_step": 2794,
      "hybrid": {"weight": 2.0, "sentence_weight": 0.25, "passages": 20}}
  assert "| compact OPQ24,PQ24, hybrid | 7 | qsft (step 2794) | 2, 0.25 | 30.00 |" in (
      scale.squad_section(section))


codec_choice = load_script("experiments/benchmarks/codec_choice.py")


def _index(dump, name, manifest, files):
  folder = dump / "indexes" / name
  folder.mkdir(parents=True)
  (folder / "index_manifest.json").write_text(json.dumps(manifest))
  for file, size in files.items():
    (folder / file).write_bytes(b"x" * size)


def _report(index, em, step=7):
  return {"index": index, "questions": 4, "fingerprint": "f", "model_step": step, "em@1": em,
          "em@10": em, "top1": em, "top5": em, "top20": em}


def test_the_section_computes_each_rows_gaps_and_speed_verdicts():
  section = _section(15_000)
  section["rows"]["compact OPQ24,PQ24, hybrid"] = {
      **section["rows"]["Flat, hybrid"], "em@1": 29.5, "top1": 58.5}
  section["rows"]["Flat, dense"] = {**section["rows"]["Flat, hybrid"], "em@1": 20.0}
  section["rows"]["compact OPQ24,PQ24, dense, reread 10"] = {
      **section["rows"]["Flat, hybrid"], "em@1": 19.25, "top1": 59.5}
  section["speed"] = {"commit": "b" * 40, "rows": {"compact OPQ24,PQ24, hybrid": {
      "batch1_p50_ms": 101.0, "batch1_p90_ms": 150.0, "batch64_questions_per_s": 18.4}}}
  text = scale.squad_section(section)
  assert ("| compact OPQ24,PQ24, hybrid | -0.50 / -1.50 (**not met**) | -16.55 / -24.79 "
          "(**not met**) | 18.40 (met) | 101 (**not met**) |") in text
  section["speed"] = section["speed"]["rows"]  # (a timing of before the commit was recorded)
  assert "| 18.40 (met) | 101 (**not met**) |" in scale.squad_section(section)
  assert "| compact OPQ24,PQ24, dense, reread 10 | -0.75 / -0.50 (met) | - | - | - |" in text


def test_codec_choice_lists_each_index_with_its_bytes_and_refuses_mixed_reports(tmp_path):
  dump = tmp_path / "w" / "dump"
  dump.mkdir(parents=True)
  (dump / "manifest.json").write_text(json.dumps({"num_tokens": 100, "complete": True,
                                                  "shards": []}))
  _index(dump, "Flat", {"resolved_spec": "Flat", "num_tokens": 100, "dim": 8},
         {"index.faiss": 3300})
  _index(dump, "compact_PQ4_filter1", {"resolved_spec": "compact:PQ4", "num_tokens": 40,
                                       "kind": "compact", "code_size": 4,
                                       "filter_threshold": 1.0}, {"codes.npy": 160})
  reports = []
  for name, em in (("compact_PQ4_filter1", 10.0), ("Flat", 30.0)):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(_report(name, em)))
    reports.append(str(path))
  out = tmp_path / "choice.json"
  codec_choice.main(["--workdir", str(tmp_path / "w"), "--measured-at", "abc", "--reports",
                     *reports, "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [r["index"] for r in rows] == ["Flat", "compact_PQ4_filter1"]  # Flat first
  assert rows[1]["kept"] == 0.4 and rows[1]["code_bytes_per_kept_token"] == 4
  manifest_bytes = len(json.dumps({"resolved_spec": "compact:PQ4", "num_tokens": 40,
                                   "kind": "compact", "code_size": 4, "filter_threshold": 1.0}))
  assert rows[1]["index_bytes_per_corpus_token"] == (160 + manifest_bytes) / 100
  assert rows[0]["code_bytes_per_kept_token"] == 32  # float32 x 8
  other = tmp_path / "other.json"
  other.write_text(json.dumps(_report("Flat", 30.0, step=8)))
  with pytest.raises(SystemExit, match="not of the same questions and model"):
    codec_choice.main(["--workdir", str(tmp_path / "w"), "--measured-at", "abc", "--reports",
                       reports[0], str(other), "--out", str(out)])


def test_only_flats_index_command_chooses_the_hybrid_weights(tmp_path, monkeypatch):
  """A compact index missing is built without index.sparse (which would choose the BM25
  index's weights again, for Flat); the BM25 index missing is built with Flat's."""
  args = study.parse(["--config", "experiments/squad.py:cpu", "--workdir", str(tmp_path),
                      "--codec", "qw+pr:RQ24x8", "--threshold", "none"])
  rows = study.systems(args, None)
  for _, _, overrides in rows.values():
    path = study.eval_file(args, overrides)
    path.write_text(json.dumps({"questions": 10570,
                                "hits": {k: "1" * 10570 for k in study.PAIRED}}))
  (tmp_path / "dump" / "indexes" / "Flat").mkdir(parents=True)
  (tmp_path / "dump" / "indexes" / "Flat" / "index_manifest.json").write_text("{}")
  ran = []
  monkeypatch.setattr(study, "run_py", lambda mode, args, overrides: ran.append(
      (mode, overrides)) or mode)
  study.build_and_evaluate(args, None, rows)
  assert ran == [("index", ["index.specs=['Flat']", "index.sparse=True"]),
                 ("index", ["index.specs=['compact:qw+pr:RQ24x8']", "index.sparse=False"])]
  (tmp_path / "dump" / "indexes" / "bm25").mkdir()
  (tmp_path / "dump" / "indexes" / "bm25" / "sparse_manifest.json").write_text("{}")
  ran.clear()
  study.build_and_evaluate(args, None, rows)
  assert ran == [("index", ["index.specs=['compact:qw+pr:RQ24x8']", "index.sparse=False"])]
