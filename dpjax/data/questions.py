"""Open-domain questions (`Question`s with id, question text, answers and, from SQuAD files, the
gold title) read from SQuAD JSON, open-QA JSON or JSONL, and seeded samples of them."""
from __future__ import annotations

import json
import pathlib

import numpy as np

from dpjax.data.squad import DataError, Question, load_json, read_squad


def sample_questions(questions: list[Question], limit: int, seed: int) -> list[Question]:
  """`limit` questions drawn at random (seeded, file order kept); all of them when limit is 0.

  The first N questions of a SQuAD file come from a handful of articles: a sample is not."""
  if not limit or limit >= len(questions):
    return questions
  rows = np.sort(np.random.default_rng(seed).choice(len(questions), limit, replace=False))
  return [questions[i] for i in rows]


def read_questions(path: str | pathlib.Path) -> list[Question]:
  """Questions with answers from SQuAD JSON, open-QA JSON (`{"data": [{id, question, answers}]}`)
  or JSONL (`{"id", "question", "answers"}` per line)."""
  path = pathlib.Path(path)
  if path.suffix == ".jsonl":
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{number}: invalid JSON at column {e.colno}: {e.msg}") from None
  else:
    root = load_json(path)
    rows = root.get("data") if isinstance(root, dict) else None
    if not isinstance(rows, list):
      raise DataError(f"{path}: expected a 'data' list")
    if rows and isinstance(rows[0], dict) and "paragraphs" in rows[0]:  # SQuAD format
      passages, questions, _ = read_squad(path)
      return [Question(q.id, q.question, q.answers, title=passages[q.passage_index].title)
              for q in questions]
  questions, seen = [], set()
  for i, row in enumerate(rows):
    answers = row.get("answers") if isinstance(row, dict) else None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not answers:
      raise DataError(f"{path}: record {i} needs 'question' and a non-empty 'answers' list")
    question = Question(str(row.get("id", i)), row["question"],
                        [a if isinstance(a, str) else a.get("text", "") for a in answers])
    if question.id in seen:
      raise DataError(f"{path}: record {i}: duplicate question id {question.id!r}")
    seen.add(question.id)
    questions.append(question)
  return questions
