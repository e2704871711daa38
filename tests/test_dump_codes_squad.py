"""The dump-time codes study (experiments/benchmarks/dump_codes_squad.py): the reports it pairs,
GNU time's memory it reads, and the record and table it writes."""
import json

from conftest import load_script

study = load_script("experiments/benchmarks/dump_codes_squad.py")

TIME_LOG = """\tCommand being timed: "taskset -c 1 python run.py dump"
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.5
\tMaximum resident set size (kbytes): 3145728
"""


def _args(tmp_path, *more):
  return study.parse(["--config", "experiments/squad.py:cpu", "--workdir",
                      str(tmp_path / "codes"), "--reference", str(tmp_path / "reference"),
                      "--reference-index", "compact_qw_pr_OPQ24_PQ24_filter-2.91406",
                      "--threshold", "-2.9140625", "--reread-margin", "3:3", "--reread-set",
                      "index.sparse_weight=1", "--reread-set", "index.sparse_sentence_weight=0.5",
                      *more])


def test_each_row_pairs_the_reports_of_the_same_search_over_both_indexes(tmp_path):
  from compact_squad import eval_file
  args = _args(tmp_path)
  ours = {name: eval_file(args, overrides).name
          for name, overrides in study.rows_of(args, "compact_qw_pr_OPQ24_PQ24").items()}
  assert ours == {
      "dense": "open_eval_compact_qw_pr_OPQ24_PQ24.json",
      "hybrid": "open_eval_compact_qw_pr_OPQ24_PQ24_hybrid.json",
      "hybrid, reread 3 within 3":
          "open_eval_compact_qw_pr_OPQ24_PQ24_hybrid_reread3_m3_w1_s0.5.json"}
  reference = tmp_path / "reference"
  reference.mkdir()
  folder = "compact_qw_pr_OPQ24_PQ24_filter-2.91406"
  for suffix in ("", "_hybrid", "_hybrid_reread3_m3_w1_s0.5"):
    (reference / f"open_eval_{folder}{suffix}.json").write_text(json.dumps({"row": suffix}))
  assert [r["row"] for r in study.reference_reports(args).values()] == [
      "", "_hybrid", "_hybrid_reread3_m3_w1_s0.5"]


def test_peak_memory_is_read_from_gnu_times_output(tmp_path):
  log = tmp_path / "dump.err"
  log.write_text("INFO other lines\n" + TIME_LOG)
  assert study.peak_memory(str(log)) == {"log": str(log), "peak_gib": 3.0,
                                         "wall_seconds": 3723.5}
  assert study.peak_memory(None) is None


def test_the_record_pairs_every_question_and_counts_the_dumps_bytes(tmp_path, monkeypatch):
  args = _args(tmp_path, "--dump-log", str(tmp_path / "dump.err"))
  (tmp_path / "dump.err").write_text(TIME_LOG)
  dump = tmp_path / "codes" / "dump"
  (dump / "shard_00000").mkdir(parents=True)
  (dump / "shard_00001").mkdir()
  for shard in ("shard_00000", "shard_00001"):
    (dump / shard / "codes.npy").write_bytes(b"x" * 300)
  (dump / "codec.faiss").write_bytes(b"x" * 100)
  codec = {"sample": {"passages": 12, "reads": 2, "kept_tokens": 40}, "train_tokens": 30,
           "means_codec": "SQfp16"}
  (dump / "manifest.json").write_text(json.dumps({
      "context_tokens": 100, "num_tokens": 30, "seconds": 9.0, "codec": codec}))
  index = dump / "indexes" / "compact_qw_pr_OPQ24_PQ24"
  index.mkdir(parents=True)
  (index / "index_manifest.json").write_text(json.dumps({"build_seconds": 2.0}))
  (tmp_path / "reference" / "dump").mkdir(parents=True)
  (tmp_path / "reference" / "dump" / "manifest.json").write_text(
      json.dumps({"bytes_per_token": 789.0, "seconds": 7.0}))
  monkeypatch.setattr("dpjax.index.manifest.read_manifest",
                      lambda d: {"num_tokens": 100})
  hits = {"em@1": "1100", "top1": "1111", "top20": "1111"}
  report = {"questions": 4, "em@10": 50.0, "top5": 100.0, "hits": hits,
            "em@1": 50.0, "top1": 100.0, "top20": 100.0}
  theirs = {**report, "em@1": 25.0, "hits": {**hits, "em@1": "0001"}}
  rows = ("dense", "hybrid", "hybrid, reread 3 within 3")
  section = study.summarise(args, {r: report for r in rows}, {r: theirs for r in rows}, {})
  assert section["rows"]["dense"]["mcnemar"]["em@1"] == (2, 1, 1.0)
  assert section["rows"]["dense"]["mcnemar"]["top1"] == (0, 0, 1.0)
  assert section["dump"]["per_token"] == {"codec.faiss": 1.0, "codes.npy": 6.0,
                                          "manifest.json": (dump / "manifest.json").stat(
                                              ).st_size / 100}
  assert section["dump"]["run"]["peak_gib"] == 3.0
  section["command"] = "python experiments/benchmarks/dump_codes_squad.py ..."
  table = study.render(section)
  assert "| dense | 50.00 / 25.00 | 100.00 / 100.00 | 100.00 / 100.00 | 2 / 1 (1) |" in table
  assert "peak resident memory 3.00 GiB" in table and "12 passages in 2 reads" in table
  assert "(the reference's float16 dump: 789.0 bytes, 7 s)" in table
