"""The hostile sweep's verdicts: the words of a message alone never make a case clean."""
import pytest

from conftest import load_script

sweep = load_script("experiments/studies/hostile_sweep.py")
PREFIX = "2026-11-27 14:54:03,117 ERROR root: "


def _verdict(tmp_path, outcome, **kwargs):
  s = sweep.Sweep(tmp_path, tmp_path)
  s.case("area", "case", lambda: outcome, **kwargs)
  return s.rows[-1]


@pytest.mark.parametrize("outcome, verdict", [
    ((2, PREFIX + "/d/c: the corpus is empty\n", 1.0), "clean"),
    ((0, PREFIX + "/d/c: the corpus is empty\n", 1.0), "silent"),  # exit 0 with an ERROR line
    ((1, PREFIX + "/d/c: the corpus is empty\n", 1.0), "silent"),
    ((2, PREFIX + "/d/c: the corpus is empty\nlater line\n", 1.0), "silent"),  # not the final
    ((2, PREFIX + "something else about the corpus\n", 1.0), "silent"),  # the word only
    ((2, PREFIX + "[Errno 17] File exists: '/d/c: the corpus is empty'\n", 1.0), "silent"),
    ((2, "Traceback (most recent call last):\n" + PREFIX + "/d/c: the corpus is empty\n", 1.0),
     "traceback"),
    ((None, "", 180.0), "hang"),
])
def test_error_cases_need_exit_2_and_the_pattern_on_the_final_line(tmp_path, outcome, verdict):
  row = _verdict(tmp_path, outcome, error=r"/c: the corpus is empty$")
  assert row["verdict"] == verdict and row["checks_result"]
  assert row["checked"] == "exit 2, final line matches `/c: the corpus is empty$`"


def test_api_cases_need_the_exception_class(tmp_path):
  raises = ("DataError", r"/no/such\.jsonl: corpus file not found$")
  good = "ERROR DataError: /no/such.jsonl: corpus file not found\n"
  assert _verdict(tmp_path, (0, good, 1.0), raises=raises)["verdict"] == "clean"
  other = good.replace("DataError", "ValueError")
  assert _verdict(tmp_path, (0, other, 1.0), raises=raises)["verdict"] == "silent"


def test_ok_cases_are_clean_only_when_their_checks_hold(tmp_path):
  with pytest.raises(ValueError, match="must check what the run produced"):
    _verdict(tmp_path, (0, "dump: 4 passages\n", 1.0))
  four = [sweep.printed(r"^dump: 4 passages$")]
  assert _verdict(tmp_path, (0, "dump: 4 passages\n", 1.0), checks=four)["verdict"] == "clean"
  row = _verdict(tmp_path, (0, "dump: 5 passages\n", 1.0), checks=four)
  assert row["verdict"] == "silent" and row["failed"] == ["output matches `^dump: 4 passages$`"]
  raising = [("a file that is missing", lambda out: (tmp_path / "nope").read_text())]
  assert _verdict(tmp_path, (0, "ok\n", 1.0), checks=raising)["verdict"] == "silent"


def test_temporaries_left_behind_fail_the_case(tmp_path):
  (tmp_path / "dump").mkdir()
  (tmp_path / "dump" / "shard_00001.tmp").mkdir()
  row = _verdict(tmp_path, (2, PREFIX + "x: broken\n", 1.0), error="x: broken",
                 clean_dir=tmp_path)
  assert row["verdict"] == "silent"
  assert row["failed"] == [f"nothing half-written in {tmp_path.name}/"]
