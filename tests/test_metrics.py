"""EM/F1 against the official SQuAD v1.1 scores of five leaderboard systems."""
import numpy as np
import pytest

from dpjax import metrics
from dpjax.data.squad import load_json

OFFICIAL = {  # ../shared/data/README.md: official evaluate-v1.1.py on dev-v1.1.json
    "bert-ensemble.json": (86.20624408703878, 92.19557978351145),
    "rnet-ensemble.json": (82.46925260170293, 88.47785965423249),
    "slqa-ensemble.json": (81.94891201513718, 88.38386312172166),
    "match-lstm-ensemble.json": (67.63481551561021, 76.75556184979695),
    "logistic-regression-baseline.json": (40.14191106906339, 50.98153647324461),
}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_reproduces_official_scores(squad_dir, name):
  dev = load_json(squad_dir / "dev-v1.1.json")
  gold = {qa["id"]: [a["text"] for a in qa["answers"]]
          for article in dev["data"] for p in article["paragraphs"] for qa in p["qas"]}
  scores = metrics.squad_em_f1(load_json(squad_dir / "ref-predictions" / name), gold)
  em, f1 = OFFICIAL[name]
  assert abs(scores["exact_match"] - em) <= 1e-9
  assert abs(scores["f1"] - f1) <= 1e-9


def test_normalisation_and_f1():
  assert metrics.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
  assert metrics.normalize_answer("an apple a day") == "apple day"
  assert metrics.exact_match("the Beatles", "Beatles") == 1.0
  assert metrics.f1("in Paris France", "Paris") == pytest.approx(0.5)
  assert metrics.f1("", "Paris") == 0.0
  assert metrics.squad_em_f1({}, {"q": ["x"]})["exact_match"] == 0.0
  assert metrics.regex_match("Barack Obama", r"(Barack )?Obama") == 1.0
  assert metrics.regex_match("Obama", r"[") == 0.0


def test_has_answer_matches_token_sequences():
  assert metrics.has_answer("The Eiffel Tower is in Paris, France.", ["paris"])
  assert not metrics.has_answer("Parisian cafes", ["Paris"])  # whole tokens only
  assert metrics.has_answer("born in 1961 in Hawaii", ["1961"])
  assert not metrics.has_answer("born in 1961", ["1962", ""])
  assert metrics.has_answer("Born in 1961.", [r"19[0-9]{2}"], regex=True)
  assert not metrics.has_answer("Born in 1961.", [r"19[0-9]{2", "x"], regex=True)  # invalid


def test_has_answer_decides_as_dprs():
  """DPR's `has_answer` (its SimpleTokenizer's tokens): punctuation is a token of its own,
  articles are kept, accents compared after NFD, and a regex is searched in NFD text."""
  assert metrics.has_answer("Obama's birthplace is Hawaii", ["Obama"])
  assert metrics.has_answer("a rock-and-roll band", ["rock"])
  assert metrics.has_answer("the 1911-1912 season", ["1911"])
  assert metrics.has_answer("the 1911-1912 season", ["1911 - 1912"])
  assert not metrics.has_answer("Beatles songs", ["The Beatles"])  # SQuAD's normal form: found
  assert not metrics.has_answer("Beatles songs", ["Beatle"])
  assert metrics.has_answer("Cafe\u0301 de Flore", ["Caf\u00e9"])  # decomposed vs composed
  assert not metrics.has_answer("Café de Flore", ["Cafe"])  # the accent is part of the token
  assert metrics.has_answer("U.S. Army", ["U.S"]) and not metrics.has_answer("US Army", ["U.S."])
  assert metrics.has_answer("won in 1990\u00a0AD", ["1990 ad"])  # a no-break space separates
  assert metrics.has_answer("Caf\u00e9 de Flore", ["cafe\u0301 de"], regex=True)
  assert metrics.dpr_tokens("“Hi,” she said—twice") == [
      "“", "hi", ",", "”", "she", "said", "—", "twice"]


def _dpr_reference_tokens(text: str) -> list[str]:
  """DPR's SimpleTokenizer written out by Unicode category: runs of letters, numbers and marks,
  and each other character that is not a separator (Z*) or control/format (C*) alone."""
  import unicodedata
  tokens, run = [], ""
  for ch in unicodedata.normalize("NFD", text):
    kind = unicodedata.category(ch)[0]
    if kind in "LNM":
      run += ch
      continue
    if run:
      tokens.append(run)
      run = ""
    if kind not in "ZC":
      tokens.append(ch)
  return [t.lower() for t in tokens + ([run] if run else [])]


def test_has_answer_equals_dprs_token_window_search():
  def windows(text, answers):  # DPR's loop over the passage's token windows (an empty answer
    tokens = _dpr_reference_tokens(text)  # matches nothing here: DPR's matches everything)
    for answer in answers:
      target = _dpr_reference_tokens(answer)
      if target and any(tokens[i:i + len(target)] == target
                        for i in range(len(tokens) - len(target) + 1)):
        return True
    return False

  rng = np.random.default_rng(0)
  words = ["a", "the", "An", "ab", "b", "ba", "c,", "C", "a.b", "x-y", "xy", "  ", "!", "é",
           "e\u0301", "É", "’s", "1,000", "\t", "\u00a0", "x\u200by", "½", "٣"]
  for _ in range(3000):
    text = " ".join(rng.choice(words, size=rng.integers(0, 12)))
    answers = [" ".join(rng.choice(words, size=rng.integers(0, 4)))
               for _ in range(rng.integers(1, 3))]
    assert metrics.has_answer(text, answers) == windows(text, answers), (text, answers)
    assert metrics.dpr_tokens(text) == _dpr_reference_tokens(text), text


def test_open_domain_and_passage_scores():
  preds = [["Paris", "Lyon"], ["Rome", "Milan"], []]
  golds = [["paris"], ["Milan"], ["x"]]
  scores = metrics.open_domain_scores(preds, golds, ks=(1, 2))
  assert scores["em@1"] == pytest.approx(100 / 3)
  assert scores["em@2"] == pytest.approx(200 / 3)
  retrieved = [["no", "it is Paris"], ["Milan here", "and Milan"], ["nothing"]]
  p = metrics.passage_scores(retrieved, golds, ks=(1, 2), mrr_k=2, precision_k=2)
  assert p["top1"] == pytest.approx(100 / 3) and p["top2"] == pytest.approx(200 / 3)
  assert p["mrr@2"] == pytest.approx(100 * (0.5 + 1) / 3)
  assert p["p@2"] == pytest.approx(100 * (0.5 + 1.0 + 0) / 3)


def test_average_precision():
  from dpjax.metrics import average_precision
  rng = np.random.default_rng(0)
  labels = rng.random(200_000) < 0.07
  assert average_precision(labels * 2.0 + rng.random(200_000), labels) == pytest.approx(1.0)
  random_ap = average_precision(rng.random(200_000), labels)
  assert abs(random_ap - labels.mean()) < 0.005  # a random scorer: the positive rate
  # By hand: positives at ranks 1 and 3 of 4 -> (1/1 + 2/3) / 2; ties form one threshold.
  assert average_precision([4, 3, 2, 1], [1, 0, 1, 0]) == pytest.approx((1 + 2 / 3) / 2)
  assert average_precision([1, 1, 1, 1], [1, 0, 0, 0]) == pytest.approx(0.25)
  assert np.isnan(average_precision([1, 2], [0, 0]))
