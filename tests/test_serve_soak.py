"""The soak: its verdicts (measured only over two windows with good requests and checked
answers), its oracle comparison, and a short soak over a tiny workdir with an API key."""
import copy
import json

import pytest

from conftest import load_script

import run

soak = load_script("experiments/benchmarks/serve_soak.py")
CONFIG = "experiments/demo.py:tiny"
KEY = "soak-test-key_0123456789"


def _window(requests, rss, p99):
  return {"requests": requests, "rss_mb": rss, "p50_ms": p99 and p99 / 2, "p99_ms": p99,
          "statuses": {"200": 10}}


def _verdicts(windows, unexpected=None, right=10, wrong=0):
  return soak.verdicts({"windows": windows, "unexpected": unexpected or {},
                        "answers": {"right": right, "wrong": wrong}})


def test_verdicts_need_two_windows_with_good_requests_and_checked_answers():
  one = _verdicts([_window(1000, 100.0, 50.0)])
  assert one["ok"] is False and one["p99_last_over_first"] is None
  no_good = _verdicts([_window(1000, 100.0, None), _window(2000, 100.0, 50.0)])
  assert no_good["ok"] is False and no_good["p99_last_over_first"] is None
  two = _verdicts([_window(1000, 100.0, 50.0), _window(2000, 105.0, 60.0)])
  assert two["ok"] is True and abs(two["rss_growth_after_warmup"] - 0.05) < 1e-12
  assert two["p99_last_over_first"] == 60.0 / 50.0 and two["wrong_answers"] == 0
  drift = _verdicts([_window(1000, 100.0, 50.0), _window(2000, 100.0, 80.0)])
  assert drift["ok"] is False
  bad = _verdicts([_window(1000, 100.0, 50.0), _window(2000, 100.0, 50.0)], {"k: 200": 1})
  assert bad["ok"] is False and bad["unexpected_statuses"] == 1
  wrong = _verdicts([_window(1000, 100.0, 50.0), _window(2000, 100.0, 50.0)], wrong=1)
  assert wrong["ok"] is False and wrong["wrong_answers"] == 1
  unchecked = _verdicts([_window(1000, 100.0, 50.0), _window(2000, 100.0, 50.0)], right=0)
  assert unchecked["ok"] is False and unchecked["wrong_answers"] is None


def _results():
  """Two phrase results as the service sends them (the second with merged evidence)."""
  passage = "Ada Lovelace wrote the first program in 1843 for the Analytical Engine."
  return [{"answer": "1843", "score": 23.5, "start_char": 40, "end_char": 44,
           "passage_id": "p7", "passage_row": 7, "title": "Ada Lovelace", "passage": passage},
          {"answer": "Ada Lovelace", "score": 19.25, "start_char": 0, "end_char": 12,
           "passage_id": "p7", "passage_row": 7, "title": "Ada Lovelace", "passage": passage,
           "merged": [{"answer": "Lovelace", "score": 17.0, "start_char": 4, "end_char": 12}]}]


def _altered(change):
  served = copy.deepcopy(_results())
  change(served)
  return served


@pytest.mark.parametrize("change, difference", [
    (lambda r: r[0].update(score=23.5 + 1e-3), "result 0: score 23.501 != 23.5"),
    (lambda r: r[1].update(end_char=11), "result 1: end_char 11 != 12"),
    (lambda r: r[0].update(answer="1844"), "result 0: answer '1844' != '1843'"),
    (lambda r: r[0].update(passage_id="p8"), "result 0: passage_id 'p8' != 'p7'"),
    (lambda r: r[0].update(passage=r[0]["passage"][:-1]), "result 0: passage"),
    (lambda r: r.reverse(), "result 0: answer 'Ada Lovelace' != '1843' (scores 19.25 and 23.5)"),
    (lambda r: r.pop(), "1 results, expected 2"),
    (lambda r: r[1].pop("title"), "result 1: field title missing"),
    (lambda r: r[1]["merged"][0].update(score=16.0), "result 1: merged result 0: score 16.0"),
    (lambda r: r[0].update(score="23.5"), "result 0: score '23.5' != 23.5"),
])
def test_an_altered_answer_is_counted_wrong(change, difference):
  search = ("Who wrote the first program?", 2, "phrase")
  answers = soak.Answers({search: json.loads(json.dumps(_results()))})
  served = _altered(change)
  assert soak.first_difference(served, _results()).startswith(difference)
  answers.check({"question": search[0], "k": 2, "unit": "phrase", "results": served}, search)
  summary = answers.summary()
  assert (summary["right"], summary["wrong"], summary["wrong_searches"]) == (0, 1, 1)
  assert summary["wrong_examples"][0]["difference"].startswith(difference)


def test_scores_agree_within_rounding_and_the_rest_exactly():
  search = ("Who wrote the first program?", 2, "phrase")
  answers = soak.Answers({search: _results()})
  rounded = _altered(lambda r: r[0].update(score=23.5 * (1 + 2 ** -22)))  # two float32 ulps
  assert soak.first_difference(rounded, _results()) is None
  for served in (_results(), rounded):
    answers.check({"question": search[0], "k": 2, "unit": "phrase", "results": served}, search)
  answers.check({"question": search[0], "k": 3, "unit": "phrase", "results": _results()},
                search)  # the answer to another request
  summary = answers.summary()
  assert (summary["right"], summary["bit_identical"], summary["wrong"]) == (2, 1, 1)
  assert summary["largest_score_difference"] == pytest.approx(23.5 * 2 ** -22)
  assert summary["wrong_examples"][0]["difference"].startswith("answers ('Who wrote")


def test_the_key_is_the_environments_or_a_random_one(monkeypatch):
  from dpjax.config import load_config
  config = load_config(CONFIG)
  monkeypatch.setenv("DPJAX_API_KEY", KEY)
  assert soak.soak_key(config) == ("DPJAX_API_KEY", KEY)
  monkeypatch.delenv("DPJAX_API_KEY")
  name, key = soak.soak_key(config)
  assert name == "DPJAX_API_KEY" and len(key) >= 16 and key != soak.soak_key(config)[1]
  config.serve.api_key_env = ""
  with pytest.raises(SystemExit, match="serve.api_key_env must name a variable"):
    soak.soak_key(config)


@pytest.fixture(scope="module")
def tiny_workdir(tmp_path_factory):
  """A workdir of the tiny config with a dump and its Flat index (the untrained encoder)."""
  workdir = tmp_path_factory.mktemp("soak")
  for mode in ("dump", "index"):
    assert run.main([mode, "--config", CONFIG, "--workdir", str(workdir),
                     "--set=eval.allow_untrained=True"]) == 0
  return workdir


@pytest.mark.slow
def test_a_short_soak_with_a_key_gets_every_answer_right(tiny_workdir, tmp_path, monkeypatch):
  """Good answers all equal the oracle's; the key reaches the server through its environment
  only: never its command line, the soak's or the report."""
  monkeypatch.setenv("DPJAX_API_KEY", KEY)
  started, start_serving = [], soak.start_serving
  monkeypatch.setattr(soak, "start_serving", lambda command, env=None: started.append(
      (command, env)) or start_serving(command, env=env))
  out = tmp_path / "soak.json"
  argv = ["--config", CONFIG, "--workdir", str(tiny_workdir), "--set=eval.allow_untrained=True",
          "--set=serve.max_batch=8", "--requests", "400", "--clients", "6", "--window", "200",
          "--bad-fraction", "0.3", "--out", str(out)]
  results = soak.main(argv)
  answers = results["answers"]
  assert answers["wrong"] == 0 and answers["right"] > 200, answers["wrong_examples"]
  assert results["verdicts"]["wrong_answers"] == 0 and results["unexpected"] == {}
  assert set(results["kinds"]) == {"good", *soak.BAD} and results["auth"] is True
  assert answers["oracle_searches"] >= len(soak.SEARCHES)
  assert len(results["commit"]) >= 40 and results["server_exit"] == 0
  (command, env), = started
  assert env["DPJAX_API_KEY"] == KEY and KEY not in " ".join(command + argv)
  for written in (out, out.with_suffix(".md")):
    assert KEY not in written.read_text()
  assert "wrong answers | 0 | 0" in out.with_suffix(".md").read_text()
