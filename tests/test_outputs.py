"""Standard outputs: eval reports per corpus (dump), a TREC run file, the `dpjax` command."""
import json
import logging
import pathlib
import subprocess
import sys

from conftest import REPO
from dpjax.data.corpus import read_corpus
from dpjax.data.squad import Question
from dpjax.index.evaluate import trec_ids, write_trec

import run


def _trec(path: pathlib.Path) -> dict[str, list[tuple[str, int, float]]]:
  runs: dict[str, list] = {}
  for line in path.read_text().splitlines():
    qid, q0, docid, rank, score, tag = line.split(" ")
    assert q0 == "Q0" and tag == "dpjax"
    runs.setdefault(qid, []).append((docid, int(rank), float(score)))
  return runs


def test_two_corpora_keep_their_reports_and_trec_runs(tmp_path):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(["train"] + base) == 0
  few = tmp_path / "few.jsonl"
  passages = list(read_corpus(tmp_path / "data" / "corpus.json"))[:12]
  few.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n"
                         for p in passages))
  other = ["--set", "index.dump_name=few", "--set", f"index.corpus=['{few}']"]
  for mode in ("dump", "index", "eval"):
    assert run.main([mode] + base) == 0
    assert run.main([mode] + base + other) == 0
  default, small = (json.loads((tmp_path / f).read_text())
                    for f in ("open_eval_Flat.json", "open_eval_few_Flat.json"))
  assert default["dump_passages"] > 12 and small["dump_passages"] == 12  # neither overwritten
  for name, ids in (("open_run_Flat.trec", None), ("open_run_few_Flat.trec",
                                                   {p.id for p in passages})):
    runs = _trec(tmp_path / name)
    assert len(runs) == default["questions"]
    for ranking in runs.values():
      assert [r for _, r, _ in ranking] == list(range(1, len(ranking) + 1))
      scores = [s for _, _, s in ranking]
      assert scores == sorted(scores, reverse=True)
      assert len({d for d, _, _ in ranking}) == len(ranking)  # a passage once per question
      assert ids is None or {d for d, _, _ in ranking} <= ids
  predictions = (tmp_path / "open_predictions_few_Flat.jsonl").read_text().splitlines()
  assert len(predictions) == small["questions"]


def test_dpjax_command():
  script = pathlib.Path(sys.executable).parent / "dpjax"
  command = [str(script)] if script.exists() else [sys.executable, "-m", "dpjax.cli"]
  result = subprocess.run(command + ["--help"], cwd=REPO, capture_output=True, text=True)
  from dpjax.cli import MODES
  assert result.returncode == 0 and "{" + ",".join(MODES) + "}" in result.stdout


def test_trec_ids_with_whitespace_are_rewritten_never_merged(tmp_path, caplog):
  questions = [Question("q 1", "?", ["a"]), Question("q2", "?", ["b"])]
  ranked = [[("p 1", 2.5), ("p2", 1.0)], [("p2", 3.0)]]
  path = tmp_path / "run.trec"
  with caplog.at_level(logging.WARNING):
    assert write_trec(path, questions, ranked) is None
  assert path.read_text().splitlines() == ["q_1 Q0 p_1 1 2.500000 dpjax",
                                           "q_1 Q0 p2 2 1.000000 dpjax",
                                           "q2 Q0 p2 1 3.000000 dpjax"]
  assert "2 question or passage ids hold whitespace" in caplog.text
  # "p 1" and "p_1" would both be "p_1" (one passage to trec_eval): no run file at all, and an
  # earlier one is not left behind to be read as this run's.
  ranked[1].append(("p_1", 0.5))
  with caplog.at_level(logging.ERROR):
    why = write_trec(path, questions, ranked)
  assert why == "passage ids 'p 1' and 'p_1' would both be 'p_1' (whitespace splits a TREC line)"
  assert not path.exists() and "run.trec not written" in caplog.text
  assert trec_ids(["", "x\ty", "x y z"], "question") == {"": "_", "x\ty": "x_y",
                                                          "x y z": "x_y_z"}
