"""The hostile sweep's verdicts: every check a case records can fail, and a case is clean only
when all of them hold; its fast subset runs here (`make test`)."""
import itertools
import json

import pytest

from conftest import load_script

sweep = load_script("experiments/studies/hostile_sweep.py")
PREFIX = "2026-11-27 14:54:03,117 ERROR root: "
EMPTY = r"/c: the corpus is empty$"


def _workdir(tmp_path):
  w = tmp_path / "w"
  w.mkdir(exist_ok=True)
  (w / "manifest.json").write_text('{"complete": true}')
  return w


def _row(tmp_path, run, **kwargs):
  """The row of one case whose run is `run()` (or an outcome given as is)."""
  s = sweep.Sweep(tmp_path, tmp_path)
  s.case("area", "case", run if callable(run) else lambda: run, **kwargs)
  return s.rows[-1]


def _failed_kinds(row):
  return {c["kind"] for c in row["checks"] if c["passed"] is False}


@pytest.mark.parametrize("outcome, verdict, failed", [
    ((2, PREFIX + "/d/c: the corpus is empty\n", 1.0), "clean", set()),
    ((0, PREFIX + "/d/c: the corpus is empty\n", 1.0), "silent", {"exit_status"}),
    ((1, PREFIX + "/d/c: the corpus is empty\n", 1.0), "silent", {"exit_status"}),
    ((2, PREFIX + "/d/c: the corpus is empty\nlater line\n", 1.0), "silent", {"message"}),
    ((2, PREFIX + "something else about the corpus\n", 1.0), "silent", {"message"}),  # a word
    ((2, PREFIX + "[Errno 17] File exists: '/d/c: the corpus is empty'\n", 1.0), "silent",
     {"message"}),
    ((2, "Traceback (most recent call last):\n" + PREFIX + "/d/c: the corpus is empty\n", 1.0),
     "traceback", set()),
    ((None, "", 180.0), "hang", {"exit_status", "message"}),
])
def test_a_refusal_needs_exit_2_the_pattern_on_the_final_line_and_its_artifacts(
    tmp_path, outcome, verdict, failed):
  row = _row(tmp_path, outcome, error=EMPTY, unchanged=[_workdir(tmp_path)])
  assert row["verdict"] == verdict and _failed_kinds(row) == failed
  assert row["refusal"] and row["kinds"] == ["exit_status", "message", "artifacts_unchanged"]
  assert [c["what"] for c in row["checks"]] == [
      "exit 2", f"final line matches `{EMPTY}`", "every file under w unchanged"]


@pytest.mark.parametrize("change", ["a file added", "a file rewritten", "a file removed",
                                    "a folder added"])
def test_a_refusal_that_changed_its_artifacts_is_not_clean(tmp_path, change):
  w = _workdir(tmp_path)

  def refuse_after_writing():
    if change == "a file added":
      (w / "half.tmp").write_text("x")
    elif change == "a file rewritten":
      (w / "manifest.json").write_text('{"complete": false}')
    elif change == "a file removed":
      (w / "manifest.json").unlink()
    else:
      (w / "c").mkdir()
    return 2, PREFIX + "/d/c: the corpus is empty\n", 1.0
  row = _row(tmp_path, refuse_after_writing, error=EMPTY, unchanged=[w])
  assert row["verdict"] == "silent" and _failed_kinds(row) == {"artifacts_unchanged"}
  assert row["failed"][0].startswith("every file under w unchanged: changed w/")


def test_named_exceptions_of_the_unchanged_check(tmp_path):
  w, runs = _workdir(tmp_path), itertools.count()

  def refuse_after_stamping():
    (w / ".dpjax_verified.json").write_text(str(next(runs)))  # ALLOWED_CHANGES: other each run
    (w / "metrics.jsonl").write_text("{}\n")
    return 2, PREFIX + "/d/c: the corpus is empty\n", 1.0
  row = _row(tmp_path, refuse_after_stamping, error=EMPTY, unchanged=[w],
             allowed=[r"^w/metrics\.jsonl$"])
  assert row["verdict"] == "clean"
  assert row["checks"][-1]["what"] == "every file under w unchanged (but `^w/metrics\\.jsonl$`)"
  (w / "metrics.jsonl").write_text("older\n")
  row = _row(tmp_path, refuse_after_stamping, error=EMPTY, unchanged=[w])
  assert row["verdict"] == "silent" and _failed_kinds(row) == {"artifacts_unchanged"}
  assert "w/metrics.jsonl (" in row["failed"][0] and ".dpjax_verified" not in row["failed"][0]


def test_api_refusals_need_the_exception_class_and_exit_2(tmp_path):
  raises = ("DataError", r"/no/such\.jsonl: corpus file not found$")
  good = "ERROR DataError: /no/such.jsonl: corpus file not found\n"
  w = _workdir(tmp_path)
  assert _row(tmp_path, (2, good, 1.0), raises=raises, unchanged=[w])["verdict"] == "clean"
  row = _row(tmp_path, (0, good, 1.0), raises=raises, unchanged=[w])  # printed, not raised
  assert row["verdict"] == "silent" and _failed_kinds(row) == {"exit_status"}
  row = _row(tmp_path, (2, good.replace("DataError", "ValueError"), 1.0), raises=raises,
             unchanged=[w])
  assert row["verdict"] == "silent" and _failed_kinds(row) == {"message"}


def test_a_run_is_clean_only_when_its_product_equals_the_expectation(tmp_path):
  answers = tmp_path / "answers.json"
  oracle = ["Ann", "Bob"]  # what a clean run gives, say
  expect = [("the answers a clean run gives", lambda out: json.loads(answers.read_text())
             == oracle)]

  def answer(names):
    def run():
      answers.write_text(json.dumps(names))
      return 0, "done\n", 1.0
    return run
  row = _row(tmp_path, answer(["Ann", "Bob"]), expect=expect)
  assert row["verdict"] == "clean" and not row["refusal"]
  assert row["kinds"] == ["exit_status", "message", "artifact_vs_expectation"]
  row = _row(tmp_path, answer(["Ann", "Eve"]), expect=expect)
  assert row["verdict"] == "silent" and row["failed"] == ["the answers a clean run gives"]
  answers.unlink()
  # exit 0 but a logged error as its last line (the prefix `final_line` strips): not clean
  logged = _row(tmp_path, lambda: (0, "2026-11-28 10:00:00,000 ERROR root: x\n", 1.0),
                expect=[("nothing", lambda out: True)])
  assert logged["verdict"] == "silent" and _failed_kinds(logged) == {"message"}
  missing = _row(tmp_path, lambda: (0, "done\n", 1.0), expect=expect)  # a check that raises
  assert missing["verdict"] == "silent"
  said = [sweep.printed(r"^skipped 1 record")]
  row = _row(tmp_path, answer(oracle), expect=expect, said=said)
  assert row["verdict"] == "silent" and _failed_kinds(row) == {"message"}


def test_every_case_states_what_it_checks(tmp_path):
  with pytest.raises(ValueError, match="must compare what it produced"):
    _row(tmp_path, (0, "dump: 4 passages\n", 1.0), said=[sweep.printed("4 passages")])
  with pytest.raises(ValueError, match="must check that its artifacts are unchanged"):
    _row(tmp_path, (2, PREFIX + "/d/c: the corpus is empty\n", 1.0), error=EMPTY)


def test_a_failed_setup_run_fails_the_case(tmp_path):
  w = _workdir(tmp_path)
  row = _row(tmp_path, (2, PREFIX + "/d/c: the corpus is empty\n", 1.0), error=EMPTY,
             unchanged=[w], setup=lambda: (1, "dump failed\n", 1.0))
  assert row["verdict"] == "silent" and row["failed"] == ["its setup run exits 0"]


def test_digests_cover_every_file_and_folder(tmp_path):
  w = _workdir(tmp_path)
  (w / "sub").mkdir()
  (w / "sub" / "a.npy").write_bytes(b"\0")
  digests = sweep.artifact_digests([w, tmp_path / "nope", w / "manifest.json"])
  assert set(digests) == {"w", "w/manifest.json", "w/sub", "w/sub/a.npy", "nope",
                          "manifest.json"}
  assert digests["nope"] == "absent" and digests["w/sub"] == "folder"
  assert digests["w/manifest.json"] == digests["manifest.json"] != digests["w/sub/a.npy"]


def test_the_report_counts_the_checks_made_by_kind(tmp_path):
  s = sweep.Sweep(tmp_path, tmp_path)
  w = _workdir(tmp_path)
  s.case("a", "refused", lambda: (2, PREFIX + "/d/c: the corpus is empty\n", 1.0), error=EMPTY,
         unchanged=[w])
  s.case("a", "ran", lambda: (0, "done\n", 1.0), expect=[("x", lambda out: False)])
  counts = sweep.summary(s.rows)
  assert counts["verdicts"]["clean"] == counts["verdicts"]["silent"] == 1
  assert counts["kinds"] == {"exit_status": {"cases": 2, "held": 2},
                             "message": {"cases": 2, "held": 2},
                             "artifacts_unchanged": {"cases": 1, "held": 1},
                             "artifact_vs_expectation": {"cases": 1, "held": 0}}
  assert counts["refusals_unchanged"] == {"checked": 1, "held": 1}
  text = sweep.render({"cases": s.rows, "seconds": 1.0, "commit": "abc"}, "python x.py")
  assert "at commit `abc`; the tree clean" in text and "✗ x" in text


def test_the_full_sweep_states_a_check_of_each_kind_for_every_case(tmp_path):
  """A dry run (nothing is run): >= 100 cases, each refusal checking its artifacts unchanged,
  each run its product against an expectation; the fast subset's cases all exist."""
  for subset in ("all", "fast"):
    s = sweep.Sweep(tmp_path / "base", tmp_path, subset=subset, dry=True)
    for group in sweep.GROUPS:
      group(s)
    names = [r["case"] for r in s.rows]
    assert len(names) == len(set(names))
    if subset == "fast":
      assert set(names) == sweep.FAST
  assert len(s.rows) >= 20
  s = sweep.Sweep(tmp_path / "base", tmp_path, dry=True)
  for group in sweep.GROUPS:
    group(s)
  assert len(s.rows) >= 100
  for row in s.rows:
    assert ("artifacts_unchanged" if row["refusal"] else "artifact_vs_expectation") in row["kinds"]


@pytest.mark.slow
def test_fast_subset(tmp_path, monkeypatch):
  """`--subset fast` run as the command line runs it (one CPU device): every case clean, every
  refusal's artifacts unchanged."""
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  out = tmp_path / "reliability.json"
  code = sweep.main(["--subset", "fast", "--out", str(out), "--keep", str(tmp_path / "scratch")])
  results = json.loads(out.read_text())
  rows, counts = results["cases"], results["summary"]
  assert {r["case"] for r in rows} == sweep.FAST
  assert [r["case"] for r in rows if r["verdict"] != "clean"] == [] and code == 0
  assert counts["verdicts"]["traceback"] == counts["verdicts"]["hang"] == 0
  assert counts["refusals_unchanged"] == {"checked": counts["refusals"],
                                          "held": counts["refusals"]}
  assert results["commit"] and out.with_suffix(".md").is_file()
