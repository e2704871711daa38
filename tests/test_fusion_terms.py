"""experiments/studies/fusion_terms.py's offline ranking, by hand (the study itself needs a
trained workdir)."""
import numpy as np
import pytest

from conftest import load_script

study = load_script("experiments/studies/fusion_terms.py")

# One question, two candidate passages: the first has the better dense span (not an answer) and
# a worse one that is; the second holds the answer, with a lower best span but more BM25.
FOUND = [{"rows": np.array([4, 9]), "passages": [
    {"scores": np.array([3.0, 1.0], np.float32), "em": [False, True], "has": False},
    {"scores": np.array([2.5], np.float32), "em": [True], "has": True}]}]
BM25 = [np.array([0.0, 1.0])]


def test_passages_rank_by_their_best_fused_span():
  assert study.rank(FOUND, BM25, 0.0) == {"em@1": 0.0, "top1": 0.0}
  assert study.rank(FOUND, BM25, 1.0) == {"em@1": 100.0, "top1": 100.0}  # 2.5 + 1 > 3
  lse = study.AGGREGATES["log-sum-exp, T 1"]
  assert lse(FOUND[0]["passages"][0]["scores"]) == pytest.approx(np.log(np.exp(3) + np.exp(1)))


def test_the_sentence_term_can_pick_another_span_of_a_passage():
  sentence = [[np.array([0.0, 5.0]), np.array([0.0])]]  # the answer span's sentence matches
  got = study.rank(FOUND, BM25, 0.0, sentence=sentence, sentence_weight=1.0)
  assert got == {"em@1": 100.0, "top1": 0.0}  # 1 + 5 beats 3: the right span, not its passage
  assert study.rank(FOUND, BM25, 1.0, sentence=sentence, sentence_weight=0.0) == study.rank(
      FOUND, BM25, 1.0)
  assert study.best_of({"a": {"em@1": 1, "top1": 1}, "b": {"em@1": 2, "top1": 1}})[0] == "b"
  tied = {"a": {"em@1": 2, "top1": 1}, "b": {"em@1": 1, "top1": 2}}
  assert study.best_of(tied)[0] == "a"  # ties: the first (the grid's smaller weights)
