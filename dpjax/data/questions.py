"""Open-domain questions (`Question`s with id, question text, answers and, from SQuAD files, the
gold title) read from SQuAD JSON, open-QA JSON or JSONL, and seeded samples of them."""
from __future__ import annotations

import json
import logging
import pathlib

import numpy as np

from dpjax.data.squad import DataError, Question, load_json, read_squad

log = logging.getLogger(__name__)


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
    try:
      text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{path}: not UTF-8 (byte {e.start}: {e.reason})") from None
    for number, line in enumerate(text.splitlines(), 1):
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
      return _squad_questions(path)
  questions, seen = [], set()
  for i, row in enumerate(rows):
    where = f"{path}:{i + 1}" if path.suffix == ".jsonl" else f"{path}: record {i}"
    answers = row.get("answers") if isinstance(row, dict) else None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not answers:
      raise DataError(f"{where} needs 'question' and a non-empty 'answers' list")
    question = Question(str(row.get("id", i)), row["question"], _answer_texts(answers, where))
    if question.id in seen:
      raise DataError(f"{path}: record {i}: duplicate question id {question.id!r}")
    seen.add(question.id)
    questions.append(question)
  return questions


def _answer_texts(answers, where: str) -> list[str]:
  """The answers' texts: a list of non-empty strings (or of {"text": ...} objects); anything
  else is refused (a bare string would be read letter by letter, an empty text matches an empty
  prediction)."""
  texts = [a.get("text") if isinstance(a, dict) else a
           for a in (answers if isinstance(answers, list) else [answers])]
  if not isinstance(answers, list) or not all(isinstance(t, str) and t.strip() for t in texts):
    raise DataError(f"{where}: 'answers' must be a list of non-empty strings (or of objects "
                    f"with a non-empty 'text'), got {json.dumps(answers)[:200]}")
  return texts


def _squad_questions(path: pathlib.Path) -> list[Question]:
  """A SQuAD file's questions with their gold titles. Open-domain questions need answer texts,
  not spans: a question whose answer is not found in its paragraph is kept; one without any
  answer text is skipped, and the skipped records are logged."""
  passages, questions, summary = read_squad(path, require_answers=False)
  kept = [Question(q.id, q.question, q.answers, title=passages[q.passage_index].title)
          for q in questions if q.answers]
  for q in questions:
    if not q.answers:
      summary.skip("question without answer texts", f"question {q.id}")
  if summary.total:
    log.warning("%s", summary)
  return kept
