"""Validation subcorpora, hard-negative mining and training, best-checkpoint selection."""
import json
import logging
import types

import numpy as np
import pytest

from dpjax import metrics, validation
from dpjax.checkpoint import Checkpointer
from dpjax.trainer import MetricsWriter
from dpjax.config import load_config
from dpjax.data.questions import read_questions
from dpjax.data.squad import Passage, Question, read_squad
from dpjax.data.windows import build_windows
from dpjax.errors import DataError
from dpjax.data.hard_negatives import HardNegatives
from dpjax.mining import filter_negatives
from dpjax.settings import Settings
from dpjax.training import random_with_answer
from dpjax.validation import Validator

import run


def test_subcorpora_properties():
  c0 = np.array([3, 7, 11])
  rng = np.random.default_rng(0)
  retrieved = [rng.integers(0, 50, size=32).tolist() for _ in range(5)]
  previous = c0
  for k in (1, 2, 4, 8, 16, 32):
    hard = validation.select(f"H{k}", 50, c0, retrieved)
    assert set(c0) <= set(hard) and set(previous) <= set(hard)  # contains C_0, grows with k
    assert set(hard) == set(c0) | {p for ranked in retrieved for p in ranked[:k]}
    previous = hard
  r = validation.select("R0.5", 50, c0, seed=1)
  assert len(r) == 25 and set(c0) <= set(r)
  np.testing.assert_array_equal(r, validation.select("R0.5", 50, c0, seed=1))  # seeded
  assert not np.array_equal(r, validation.select("R0.5", 50, c0, seed=2))
  assert len(validation.select("R0.01", 50, c0)) == 3  # never smaller than C_0
  np.testing.assert_array_equal(validation.select("full", 5, c0[:1]), np.arange(5))
  for bad in ("H0", "H1.5", "R0", "R2", "X3", "C1"):
    with pytest.raises(ValueError):
      validation.select(bad, 50, c0, retrieved)


def test_filter_negatives_drops_answers_and_gold():
  texts = ["Paris is the capital.", "Berlin, the capital.", "It is in Paris!", "London."]
  retrieved = [(0, 0), (1, 3), (2, 9), (1, 0), (3, 1)]
  passages, starts = filter_negatives(retrieved, ["paris"], texts, gold_passage=1)
  assert passages == [3] and starts == [1]  # 0 and 2 contain the answer, 1 is the gold one


def _tiny_pipeline(workdir):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0, mode
  return base


def test_subcorpus_mining_and_hard_negative_training(tmp_path, capsys, caplog):
  base = _tiny_pipeline(tmp_path)
  assert run.main(["subcorpus"] + base +
                  ["--set", "validation.kinds=['C0','R0.5','H1','H2','H4']"]) == 0
  out = tmp_path / "subcorpora"
  rows = {}
  for kind in ("C0", "R0.5", "H1", "H2", "H4"):
    meta = json.loads((out / f"{kind}.meta.json").read_text())
    ids = [json.loads(line)["id"] for line in (out / f"{kind}.jsonl").read_text().splitlines()]
    assert meta["passages"] == len(ids) and meta["tokens"] > 0 and meta["kind"] == kind
    rows[kind] = set(ids)
  assert rows["C0"] <= rows["H1"] <= rows["H2"] <= rows["H4"]
  assert rows["C0"] <= rows["R0.5"]
  _, dev_questions, _ = read_squad(tmp_path / "data" / "dev.json")
  assert len(rows["C0"]) == len({q.passage_index for q in dev_questions})  # passages asked about

  # A seeded random sample of the dev questions: written out, C0 = its gold passages only.
  assert run.main(["subcorpus"] + base + ["--set", "validation.kinds=['C0','H2']",
                                          "--set", "validation.sample_questions=5"]) == 0
  sample_passages, sample, _ = read_squad(out / "questions_n5_seed0.json")
  assert len(sample) == 5 and {q.id for q in sample} < {q.id for q in dev_questions}
  assert [q.id for q in sample] != [q.id for q in dev_questions[:5]]  # drawn, not the first 5
  meta = json.loads((out / "C0.meta.json").read_text())
  assert meta["questions"] == str(out / "questions_n5_seed0.json") and meta["sample_questions"] == 5
  c0 = [json.loads(line) for line in (out / "C0.jsonl").read_text().splitlines()]
  assert {(p["title"], p["text"]) for p in c0} == {
      (sample_passages[q.passage_index].title, sample_passages[q.passage_index].context)
      for q in sample}
  assert {p["id"] for p in c0} <= rows["C0"]
  h2 = {json.loads(line)["id"] for line in (out / "H2.jsonl").read_text().splitlines()}
  assert {p["id"] for p in c0} <= h2
  # Validating on it during training asks the sample's questions (those whose gold passages
  # it holds), not all dev questions.
  s = Settings.of(load_config("experiments/demo.py:tiny",
                              [f"validation.corpus={out / 'H2.jsonl'}"]))
  validator = Validator(s.validation, s.data, s.eval, tmp_path / "v",
                        tmp_path / "data" / "dev.json", None, None, 8, None)
  assert [q.id for q in validator.questions] == [q.id for q in sample]

  # Mining: no mined passage contains a gold answer of its question, or is its gold passage.
  assert run.main(["mine"] + base + ["--set", "mine.top_k=20"]) == 0
  assert "hard negatives of" in capsys.readouterr().out
  passages, questions, _ = read_squad(tmp_path / "data" / "train.json")
  mined = [json.loads(line) for line in (tmp_path / "hard_negatives.jsonl").read_text()
           .splitlines()]
  assert [m["id"] for m in mined] == [q.id for q in questions]
  assert sum(len(m["passages"]) for m in mined) > 0
  for q, m in zip(questions, mined):
    assert q.passage_index not in m["passages"]
    for p in m["passages"]:
      assert not metrics.has_answer(passages[p].context, q.answers)

  # Training with them: h = 2 hard-negative passages per example enter the unified loss.
  hard = tmp_path / "hard"
  assert run.main(["train", "--config", "experiments/demo.py:tiny", "--workdir", str(hard),
                   "--set", f"train.hard_negatives.file={tmp_path / 'hard_negatives.jsonl'}",
                   "--set", "train.hard_negatives.per_example=2"]) == 0
  losses = [json.loads(line)["loss"] for line in (hard / "metrics.jsonl").read_text()
            .splitlines() if '"train"' in line]
  plain = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text()
           .splitlines() if '"train"' in line]
  assert len(losses) == 6 and np.isfinite(losses).all()
  assert losses[0] > plain[0]  # more negatives in the softmax: a larger loss at the same start
  # Training reports how many random negatives had to be taken with the answer: none here.
  assert json.loads((hard / "results.json").read_text())["hard_negatives_random_with_answer"] == 0
  assert "hard_negatives_random_with_answer" not in json.loads(
      (tmp_path / "results.json").read_text())  # no hard negatives, no count
  # Mined again into the same file between a stop and the resume: refused (only the path was
  # compared, so the run went on with other negatives).
  copy = tmp_path / "hard_copy.jsonl"
  copy.write_text((tmp_path / "hard_negatives.jsonl").read_text())
  again = ["train", "--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path / "hard2"),
           "--set", f"train.hard_negatives.file={copy}", "--set",
           "train.hard_negatives.per_example=2"]
  assert run.main(again + ["--set", "train.stop_at_step=3"]) == 0
  copy.write_text("".join(json.dumps({**m, "passages": [], "start_chars": []}) + "\n"
                          for m in mined))
  caplog.clear()
  assert run.main(again) == 2
  assert "trained with other hard_negatives than the configured files" in caplog.text
  # Rows that are not training passages (mined from other data): named, not an IndexError.
  foreign = tmp_path / "foreign.jsonl"
  foreign.write_text(json.dumps({"id": mined[0]["id"], "passages": [10 ** 6],
                                 "start_chars": [0]}) + "\n")
  caplog.clear()
  assert run.main(["train", "--config", "experiments/demo.py:tiny", "--workdir",
                   str(tmp_path / "hard3"), "--set", f"train.hard_negatives.file={foreign}"]) == 2
  assert "foreign.jsonl:1: passage 1000000 is not a row of the" in caplog.text


def test_gold_rows_counts_distinct_gold_passages(tmp_path):
  """A corpus holding one gold passage twice and another not at all passed as holding both
  (the rows were counted, not the passages)."""
  dev = tmp_path / "dev.json"
  dev.write_text(json.dumps({"data": [{"title": t, "paragraphs": [{"context": f"{t} text.", "qas": [
      {"id": t, "question": "?", "answers": [{"text": t, "answer_start": 0}]}]}]}
      for t in ("A", "B")]}))
  a = Passage("a", "A", "A text.")
  assert list(validation.gold_rows([a, Passage("b", "B", "B text.")], dev)) == [0, 1]
  with pytest.raises(DataError, match="1 of 2 gold passages are not in the corpus"):
    validation.gold_rows([a, Passage("a2", "A", "A text.")], dev)


def test_hard_negative_windows(tokenizer, caplog):
  passages = [Passage("a", "A", "alpha " * 60),
              Passage("b", "B", "beta " * 10 + "gamma delta " * 40),
              Passage("c", "C", "gamma " * 5)]
  windows, _ = build_windows(tokenizer, passages, max_seq_length=32, doc_stride=16,
                             include_title=True)
  start = passages[1].text.index("gamma delta gamma", 200)
  mined = [[(1, start)], [], [(0, 0), (2, 0)]]
  questions = [Question(f"q{i}", "?", [answer], passage_index=i)
               for i, answer in enumerate(["alpha", "Gamma", "gamma"])]
  texts = [p.text for p in passages]
  sampler = HardNegatives(mined, windows, questions, texts, per_example=2, seed=0)
  batch = sampler(3, np.array([0, 1, 2]))
  assert batch["hard_input_ids"].shape == (6, 32)
  ids = batch["hard_passage_ids"].reshape(3, 2)
  assert ids[0, 0] == 1 and ids[0, 1] != 0  # the mined one, then a random one (not its own)
  assert sorted(ids[2].tolist()) == [0, 2]
  # Nothing mined: random passages other than its own and without its answer ("gamma" is in
  # passage 2 too), at every step; none had to be taken with the answer.
  for step in range(20):
    assert (sampler(step, np.array([1]))["hard_passage_ids"] == 0).all()
  assert sampler.random_with_answer == 0
  # Every other passage holds an answer: one of them all the same, counted.
  cornered = [questions[0], Question("q1", "?", ["gamma", "alpha"], passage_index=1),
              questions[2]]
  cornered = HardNegatives(mined, windows, cornered, texts, per_example=2, seed=0)
  assert set(cornered(0, np.array([1]))["hard_passage_ids"].tolist()) <= {0, 2}
  assert cornered.random_with_answer == 2
  # ... which training's end reports (summed over the processes) and warns of.
  with caplog.at_level(logging.WARNING, logger="dpjax.training"):
    assert random_with_answer(types.SimpleNamespace(hard_negatives=cornered)) == {
        "hard_negatives_random_with_answer": 2}
  assert "2 random hard negatives of these steps hold their question's answer" in caplog.text
  assert random_with_answer(types.SimpleNamespace(hard_negatives=None)) == {}
  # The mined window holds the retrieved phrase's start as a max-context token.
  window = sampler._window(1, start)
  hit = (windows.char_start[window] <= start) & (start < windows.char_end[window])
  assert (hit & windows.context_mask[window] & windows.is_max_context[window]).any()
  np.testing.assert_array_equal(sampler(3, np.array([0, 1, 2]))["hard_input_ids"],
                                batch["hard_input_ids"])  # deterministic per step


def test_validation_keeps_the_best_checkpoint(tmp_path):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(["data"] + base) == 0
  corpus = tmp_path / "data" / "corpus.json"
  assert run.main(["train"] + base + [
      "--set", f"validation.corpus={corpus}", "--set", "validation.every_steps=2",
      "--set", "validation.metric=mrr@20"]) == 0
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  validated = {r["step"]: r for r in records if r["split"] == "validation"}
  assert sorted(validated) == [2, 4, 6]
  results = json.loads((tmp_path / "results.json").read_text())
  best = max(r["mrr@20"] for r in validated.values())
  assert validated[results["best_step"]]["mrr@20"] == best == results["best_validation_mrr@20"]
  kept = [p.name for p in (tmp_path / "checkpoints_best").iterdir() if p.name.isdigit()]
  assert kept == [str(results["best_step"])]
  # eval.checkpoint=best restores that one.
  assert run.main(["eval_rc"] + base + ["--set", "eval.checkpoint=best"]) == 0
  # A resumed run's Validator knows the validations before the resume (metrics.jsonl): its
  # best() gave None for a best step validated before it.
  s = Settings.of(load_config("experiments/demo.py:tiny", [f"validation.corpus={corpus}",
                                                          "validation.metric=mrr@20"]))
  writer = MetricsWriter(tmp_path / "metrics.jsonl", 6)
  resumed = Validator(s.validation, s.data, s.eval, tmp_path, tmp_path / "data" / "dev.json",
                      None, None, 8, writer)
  assert resumed.best() == {"best_step": results["best_step"], "best_validation_mrr@20": best}
  resumed.close()
  # A step saved into checkpoints_best before a kill and validated again by the exact resume
  # (regular checkpoints lag behind) is kept: Orbax refused to save it twice, every resume failed.
  # A step of another run (other metrics) is replaced, with a warning.
  checkpointer = Checkpointer(tmp_path / "checkpoints_best", keep=1, best_metric="mrr@20")
  step = checkpointer.best_step()
  state = checkpointer.restore(None, step)
  checkpointer.save(step, *state, metrics={"mrr@20": best})
  assert checkpointer.best_step() == step and checkpointer.manager.metrics(step) == {
      "mrr@20": best}
  checkpointer.save(step, *state, metrics={"mrr@20": 0.0})
  assert checkpointer.manager.metrics(step) == {"mrr@20": 0.0}
  checkpointer.close()


def test_bad_validation_settings_are_config_errors(tmp_path, caplog):
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(["subcorpus"] + base + ["--set", "validation.kinds=['C0','Z3']"]) == 2
  assert "validation.kinds: unknown subcorpus 'Z3'" in caplog.text
  assert run.main(["subcorpus"] + base + ["--set", "validation.kinds=['R2']"]) == 2
  assert "unknown subcorpus 'R2'" in caplog.text  # (a ValueError traceback after the work)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  caplog.clear()  # an empty subcorpus: refused before training, not a KeyError at validation
  assert run.main(["train"] + base + ["--set", f"validation.corpus={empty}", "--set",
                                      "validation.every_steps=3"]) == 2
  assert "empty" in caplog.text and not (tmp_path / "checkpoints").exists()
  # A metric validation does not report fails before training, not after `every_steps`.
  assert run.main(["train"] + base + ["--set", "validation.metric=em@5",
                                      "--set", "validation.corpus=x.jsonl"]) == 2
  assert "validation.metric 'em@5' is not one of" in caplog.text
  assert run.main(["train"] + base + ["--set", "validation.corpus=missing.jsonl"]) == 2
  assert "validation.corpus missing.jsonl: no such file" in caplog.text
  assert not (tmp_path / "checkpoints").exists()


def _one_article(path, paragraphs):
  """A SQuAD file of one article: [(context, [(id, answers)])]."""
  data = [{"title": "T", "paragraphs": [
      {"context": context, "qas": [{"id": qid, "question": f"q {qid}?", "answers": answers}
                                   for qid, answers in qas]}
      for context, qas in paragraphs]}]
  path.write_text(json.dumps({"data": data}))
  return path


def test_c0_holds_only_the_passages_of_evaluated_questions(tmp_path):
  """C_0 = the gold passages of Q_dev, the questions `read_questions` evaluates: a question
  without answer texts (SQuAD 2.0 unanswerable) is not asked, so its passage is not C_0's."""
  asked = [{"text": "Paris", "answer_start": 0}]
  dev = _one_article(tmp_path / "dev.json", [
      ("Paris is big.", [("a", asked)]),
      ("Nothing here.", [("b", [])]),  # only an unanswerable question
      ("Rome is old.", [("c", ["Lyon"])])])  # answer not located: still asked (open domain)
  corpus = [Passage("0", "T", "Paris is big."), Passage("1", "T", "Nothing here."),
            Passage("2", "T", "Rome is old."), Passage("3", "T", "Other.")]
  assert [q.id for q in read_questions(dev)] == ["a", "c"]
  np.testing.assert_array_equal(validation.gold_rows(corpus, dev), [0, 2])
