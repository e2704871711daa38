"""Answer metrics: SQuAD v1.1 official EM/F1 and open-domain EM@k / F1@k, regex answers.

`normalize_answer`, `exact_match` and `f1` follow the official SQuAD v1.1 evaluation script
exactly (lower-case, drop punctuation, drop the articles a/an/the, collapse white space; token
F1 over the bag of normalised tokens; max over the gold answers; unanswered questions score 0).
Passage Top-k decides whether a passage holds an answer as DPR does (`has_answer`).
"""
from __future__ import annotations

import collections
import functools
import math
import re
import string
import unicodedata
from typing import Iterable, Mapping, Sequence

import numpy as np
import regex as unicode_regex

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


@functools.lru_cache(maxsize=1 << 16)
def normalize_answer(text: str) -> str:
  """Lower-cases, removes punctuation and articles, and collapses white space (kept for the
  texts seen last: an evaluation compares the same gold answers with many predictions)."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
  text = _ARTICLES.sub(" ", text)
  return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
  """1.0 when the answers are equal after SQuAD's normalisation (`normalize_answer`), else 0."""
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
  """`metric` of the prediction against its best gold answer (0 without gold answers)."""
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


# DPR's `SimpleTokenizer` (DrQA's; Pyserini's and Tevatron's passage evaluation use it too): a
# token is a run of letters, digits and combining marks, or any other single character that is
# neither a separator nor a control character.
_DPR_TOKEN = unicode_regex.compile(
    r"([\p{L}\p{N}\p{M}]+)|([^\p{Z}\p{C}])",
    flags=unicode_regex.IGNORECASE | unicode_regex.UNICODE | unicode_regex.MULTILINE)


def dpr_tokens(text: str) -> list[str]:
  """The lower-cased tokens DPR's `has_answer` compares: Unicode NFD, then `SimpleTokenizer`."""
  return [m.group().lower() for m in _DPR_TOKEN.finditer(unicodedata.normalize("NFD", text))]


def has_answer(text: str, answers: Sequence[str], regex: bool = False) -> bool:
  """Whether a passage contains an answer, as DPR's `has_answer` decides it (the passage
  Top-k of DPR, DensePhrases, Pyserini and Tevatron): the answer's tokens (`dpr_tokens`) occur
  contiguously in the passage's; with `regex`, a pattern is searched anywhere in the passage
  (both NFD-normalised), case-insensitively. Punctuation is a token of its own, so "Obama" is
  found in "Obama's" and "1911" in "1911-1912"; articles are kept, so "The Beatles" is not found
  in "Beatles". An answer without tokens (or an invalid pattern) matches nothing (DPR's would
  match every passage).
  """
  if regex:
    return any(_regex_search(unicodedata.normalize("NFD", pattern), _nfd(text))
               for pattern in answers)
  # Tokens joined by single spaces (no token holds a space): a contiguous token sequence is a
  # substring bounded by spaces; the passage side is cached (passages recur across questions).
  padded = _padded_tokens(text)
  return any(target != "  " and target in padded for target in map(_padded_tokens, answers))


@functools.lru_cache(maxsize=1 << 16)
def _padded_tokens(text: str) -> str:
  return f" {' '.join(dpr_tokens(text))} "


@functools.lru_cache(maxsize=1 << 16)
def _nfd(text: str) -> str:
  return unicodedata.normalize("NFD", text)


def _regex_search(pattern: str, text: str) -> bool:
  try:
    return re.search(pattern, text, flags=re.IGNORECASE | re.UNICODE | re.MULTILINE) is not None
  except re.error:
    return False


def open_domain_scores(predictions: Sequence[Sequence[str]], answers: Sequence[Sequence[str]],
                       ks: Sequence[int] = (1, 10), regex: bool = False) -> dict[str, float]:
  """EM@k and F1@k (x100): the best over the top-k predicted answers of each question."""
  em_metric = regex_match if regex else exact_match
  scores = {}
  for k in ks:
    em = f1_total = 0.0
    for preds, golds in zip(predictions, answers):
      top = list(preds[:k])
      em += max((max_over_gold(em_metric, p, golds) for p in top), default=0.0)
      if not regex:
        f1_total += max((max_over_gold(f1, p, golds) for p in top), default=0.0)
    n = max(len(answers), 1)
    scores[f"em@{k}"] = 100.0 * em / n
    if not regex:
      scores[f"f1@{k}"] = 100.0 * f1_total / n
  return scores


def passage_scores(retrieved: Sequence[Sequence[str]], answers: Sequence[Sequence[str]],
                   ks: Sequence[int] = (1, 5, 20, 100), mrr_k: int = 20, precision_k: int = 20,
                   regex: bool = False) -> dict[str, float]:
  """Top-k accuracy, MRR@k and P@k (x100) of retrieved passage texts, by `has_answer`."""
  hits = [[has_answer(text, golds, regex) for text in texts]
          for texts, golds in zip(retrieved, answers)]
  n = max(len(hits), 1)
  scores = {f"top{k}": 100.0 * sum(any(h[:k]) for h in hits) / n for k in ks}
  scores[f"mrr@{mrr_k}"] = 100.0 * sum(
      next((1.0 / (i + 1) for i, hit in enumerate(h[:mrr_k]) if hit), 0.0) for h in hits) / n
  scores[f"p@{precision_k}"] = 100.0 * sum(sum(h[:precision_k]) / precision_k for h in hits) / n
  return scores


def average_precision(scores: Sequence[float], labels: Sequence[bool]) -> float:
  """Area under the precision-recall curve over all thresholds (average precision, as
  scikit-learn's `average_precision_score`): sum over thresholds of (recall gain) x precision,
  tied scores forming one threshold. NaN when there is no positive."""
  scores = np.asarray(scores, np.float64)
  labels = np.asarray(labels, bool)
  positives = labels.sum()
  if not positives:
    return float("nan")
  order = np.argsort(-scores, kind="stable")
  scores, labels = scores[order], labels[order]
  last_of_tie = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]
  true_pos = np.cumsum(labels)[last_of_tie]
  precision = true_pos / (last_of_tie + 1)
  recall_gain = np.diff(np.r_[0, true_pos]) / positives
  return float((recall_gain * precision).sum())


def mcnemar_p(hits_a: str, hits_b: str) -> tuple[int, int, float]:
  """(a only, b only, exact two-sided McNemar p) of two per-question 0/1 strings."""
  a_only = sum(x == "1" and y == "0" for x, y in zip(hits_a, hits_b))
  b_only = sum(x == "0" and y == "1" for x, y in zip(hits_a, hits_b))
  n = a_only + b_only
  tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1)) / 2 ** n if n else 1.0
  return a_only, b_only, min(1.0, 2 * tail)
