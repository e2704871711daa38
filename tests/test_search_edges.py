"""Search and evaluation edge cases: small and empty indexes, no passage search, EM@k at k,
documents of untitled passages."""
import copy
import json
import pathlib

import numpy as np
import pytest

from dpjax.main import eval as eval_program
from dpjax.config import load_config
from dpjax.data.squad import Passage
from dpjax.index import evaluate
from dpjax.index.dump_reader import Dump
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.units import UNITS
from dpjax.settings import Settings
from test_search import ANSWERS, _toy_dump


@pytest.fixture(scope="module")
def toy_dump(tmp_path_factory):
  directory = tmp_path_factory.mktemp("toy_audit")
  q_start, q_end = _toy_dump(directory)
  return Dump.load(directory), q_start, q_end


@pytest.mark.parametrize("unit", UNITS)
def test_an_index_without_tokens_finds_nothing(toy_dump, unit):
  """An empty subcorpus (no passage, or a filter keeping no token) answers with no units
  instead of failing (a ZeroDivisionError sizing the rescoring, faiss refusing k = 0)."""
  dump, q_start, q_end = toy_dump
  empty = PhraseIndex.over_passages(dump, [])
  assert empty.search(q_start, q_end, 3, unit) == [[] for _ in q_start]
  assert empty.search_phrases(q_start, q_end, 3) == [[] for _ in q_start]
  requests = [(3, "phrase"), (3, unit)]
  assert evaluate.retrieve(empty, q_start, q_end, requests, shared_hits=True) == \
      [[[] for _ in q_start]] * 2
  report = evaluate.retrieval_scores(empty, q_start, q_end, [[a] for _, a in ANSWERS],
                                     shared_hits=True)
  assert report["em@1"] == 0.0 and report["top20"] == 0.0


class _Searcher:
  """What `run.py eval` needs of `PhraseSearcher`: the toy index and its question vectors."""

  def __init__(self, index, q_start, q_end):
    self.index, self.q_start, self.q_end = index, q_start, q_end

  def encode(self, texts):
    return self.q_start[:len(texts)], self.q_end[:len(texts)]

  def empty_questions(self, texts):
    return [i for i, text in enumerate(texts) if not text.strip()]

  def search(self, texts, k=10, unit="phrase", **kwargs):
    found = self.index.search(*self.encode(texts), k, unit, **kwargs)
    return [[self.index.result(p, unit) for p, _ in units] for units in found]


def test_open_eval_without_passages(toy_dump, tmp_path, monkeypatch):
  """`eval.passage_k=0` (no passage metrics, as the summary line allows) writes the report and
  predictions; the TREC run is empty (it read the passages' results that were not asked for)."""
  dump, q_start, q_end = toy_dump
  questions = tmp_path / "questions.jsonl"
  questions.write_text("".join(json.dumps({"id": f"q{i}", "question": f"question {i}",
                                           "answers": [a]}) + "\n"
                               for i, (_, a) in enumerate(ANSWERS)))
  config = load_config("experiments/demo.py:tiny", [f"index.questions={questions}",
                                                     "eval.passage_k=0"])
  searcher = _Searcher(PhraseIndex.over_passages(dump), q_start, q_end)
  monkeypatch.setattr(eval_program, "open_searcher",
                      lambda settings, workdir, **kwargs: (searcher, 7))
  report = eval_program.run(Settings.of(config), str(tmp_path))
  assert report["em@1"] == 100.0 and "top20" not in report
  assert json.loads((tmp_path / "open_eval_Flat.json").read_text())["em@1"] == 100.0
  assert (tmp_path / "open_run_Flat.trec").read_text() == ""
  lines = (tmp_path / "open_predictions_Flat.jsonl").read_text().splitlines()
  assert [json.loads(line)["predictions"][0] for line in lines] == [a for _, a in ANSWERS]


def test_an_eval_at_another_nprobe_keeps_its_own_report(tmp_path):
  """An approximate index searched at a non-default nprobe names it in its files (another
  nprobe's eval overwrites nothing); Flat visits every vector and is named without it."""
  def name(*overrides):
    settings = Settings.of(load_config("experiments/demo.py:tiny", list(overrides)))
    return eval_program.report_file(settings.eval, settings.index, tmp_path).name
  compact = "index.search_index=compact_OPQ4_PQ4"
  assert name(compact) == "open_eval_compact_OPQ4_PQ4.json"
  assert name(compact, "index.nprobe=2048") == "open_eval_compact_OPQ4_PQ4_nprobe2048.json"
  assert name("index.nprobe=2048") == name() == "open_eval_Flat.json"


def _crowded_dump() -> Dump:
  """Four passages of six tokens; the first two score far above the others, and with
  max_answer_length 2 each of their tokens gives two distinct phrases (start hits pair with
  themselves, end hits with the token before): their 22 phrases fill the first 24."""
  levels, width = (10.0, 9.0, 1.0, 0.5), 6
  passages = [Passage(f"p{i}", f"T{i}", " ".join(f"w{r}" for r in range(width)))
              for i in range(len(levels))]
  vectors = np.zeros((width * len(levels), 4), np.float16)
  for row, level in enumerate(levels):
    vectors[row * width:(row + 1) * width, :2] = (level - 0.1 * np.arange(width))[:, None]
  spans = np.array([[3 * r, 3 * r + 2] for _ in levels for r in range(width)], np.int32)
  return Dump(pathlib.Path("."), {"fingerprint": "crowded"}, vectors,
              np.zeros((len(vectors), 2), np.float16),
              np.repeat(np.arange(len(levels)), width).astype(np.int32), spans, passages)


@pytest.mark.parametrize("shared_hits", [False, True])
def test_a_small_index_gives_every_unit_it_has(shared_hits):
  """k = 4 passages of an index of 4 passages (24 tokens): every token is a hit once the fetch
  reaches the index's size, so all 4 are found; the fetch stopped at 24 phrases (one per
  token) while the hits give up to 48, and the last passage was left out."""
  index = PhraseIndex.over_passages(_crowded_dump())
  q_start, q_end = np.eye(4, dtype=np.float32)[:1], np.eye(4, dtype=np.float32)[1:2]
  found = evaluate.retrieve(index, q_start, q_end, [(4, "passage"), (2, "document")],
                            shared_hits=shared_hits, max_answer_length=2)
  assert [key for _, key in found[0][0]] == [0, 1, 2, 3]
  assert [key for _, key in found[1][0]] == ["T0", "T1"]


@pytest.mark.parametrize("phrase_k", [1, 3, 10, 20])
def test_phrase_k_names_its_em_at_k(toy_dump, phrase_k):
  """EM@k / F1@k are reported at k = phrase_k (EM@1 besides): phrase_k = 3 reported the best of
  3 phrases as "em@10"; 20 reported no EM@20."""
  dump, q_start, q_end = toy_dump
  index = PhraseIndex.over_passages(dump)
  rng = np.random.default_rng(0)
  noisy = [q + rng.normal(0, 0.5, q.shape).astype(np.float32) for q in (q_start, q_end)]
  answers = [[a] for _, a in ANSWERS]
  report = evaluate.retrieval_scores(index, *noisy, answers, phrase_k=phrase_k, passage_k=0)
  assert sorted(report) == sorted({"em@1", "f1@1", f"em@{phrase_k}", f"f1@{phrase_k}"})
  found = []
  evaluate.retrieval_scores(index, *noisy, answers, phrase_k=phrase_k, passage_k=0, found=found)
  hits = [any(p.text == golds[0] for p, _ in units[:phrase_k])
          for units, golds in zip(found[0], answers)]
  assert report[f"em@{phrase_k}"] == pytest.approx(100.0 * np.mean(hits))


def test_an_untitled_passage_is_a_document_of_its_own(toy_dump):
  """Documents are the passages of one title, or an untitled passage alone: one whose id is
  another passage's title is not that title's document (both keyed on `title or id` before)."""
  dump, q_start, q_end = toy_dump
  dump = copy.copy(dump)
  dump.passages = list(dump.passages)
  dump.passages[4] = Passage("Alpha", "", dump.passages[4].text)  # untitled, id "Alpha"
  index = PhraseIndex.over_passages(dump)
  assert index._documents().tolist() == [0, 0, 1, 1, 2, 3]
  for units in index.search(q_start, q_end, 4, "document"):
    assert len(units) == 4 and len({key for _, key in units}) == 4
