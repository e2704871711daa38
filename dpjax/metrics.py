"""Answer metrics: SQuAD v1.1 official EM/F1 and open-domain EM@k / F1@k, regex answers.

`normalize_answer`, `exact_match` and `f1` follow the official SQuAD v1.1 evaluation script
exactly (lower-case, drop punctuation, drop the articles a/an/the, collapse white space; token
F1 over the bag of normalised tokens; max over the gold answers; unanswered questions score 0).
"""
from __future__ import annotations

import collections
import re
import string
from typing import Iterable, Mapping, Sequence

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
  """Lower-cases, removes punctuation and articles, and collapses white space."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
  text = _ARTICLES.sub(" ", text)
  return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
  return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
  """Token-level F1 of the normalised strings (the official SQuAD v1.1 definition)."""
  pred_tokens = normalize_answer(prediction).split()
  gold_tokens = normalize_answer(gold).split()
  common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
  overlap = sum(common.values())
  if overlap == 0:
    return 0.0
  precision = overlap / len(pred_tokens)
  recall = overlap / len(gold_tokens)
  return 2 * precision * recall / (precision + recall)


def regex_match(prediction: str, pattern: str) -> float:
  """CuratedTREC-style match: the gold answer is a regular expression matched at the start."""
  try:
    compiled = re.compile(pattern, flags=re.IGNORECASE | re.UNICODE | re.MULTILINE)
  except re.error:
    return 0.0
  return float(compiled.match(prediction) is not None)


def max_over_gold(metric, prediction: str, golds: Iterable[str]) -> float:
  return max((metric(prediction, gold) for gold in golds), default=0.0)


def squad_em_f1(predictions: Mapping[str, str],
                gold_answers: Mapping[str, Sequence[str]]) -> dict[str, float]:
  """Official SQuAD v1.1 scores (x100) of `{question id: answer}` against `{id: [answers]}`.

  Questions without a prediction score 0, as in the official script.
  """
  em = f1_total = 0.0
  for qid, golds in gold_answers.items():
    if qid not in predictions:
      continue
    em += max_over_gold(exact_match, predictions[qid], golds)
    f1_total += max_over_gold(f1, predictions[qid], golds)
  n = max(len(gold_answers), 1)
  return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1_total / n, "count": len(gold_answers)}
