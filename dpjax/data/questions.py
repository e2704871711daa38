"""Open-domain questions (`Question`s with id, question text, answers and, from SQuAD files, the
gold title) read from SQuAD JSON, open-QA JSON or JSONL, and seeded samples of them."""
from __future__ import annotations

import json
import logging
import pathlib

import numpy as np

from dpjax.data.corpus import is_jsonl
from dpjax.data.squad import (JSON_ERRORS, Question, json_problem, load_json, read_squad,
                              valid_unicode)
from dpjax.errors import DataError

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
  or JSONL (`{"id", "question", "answers"}` per line; `.jsonl`, `.ndjson`, or a file whose first
  non-blank line is one such object). A record without an id (missing, null or empty) gets its
  0-based record number. A bad record is an error naming the file and line (JSONL) or record;
  so is a file without questions."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise DataError(f"{path}: questions file not found")
  if is_jsonl(path):
    rows = _jsonl_rows(path)
  else:
    root = load_json(path)
    rows = root.get("data") if isinstance(root, dict) else None
    if not isinstance(rows, list):
      raise DataError(f"{path}: expected a 'data' list")
    if rows and isinstance(rows[0], dict) and "paragraphs" in rows[0]:  # SQuAD format
      return _nonempty(path, _squad_questions(path))
    rows = [(f"{path}: record {i}", row) for i, row in enumerate(rows)]
  questions, seen = [], {}  # id: (where, made from the record number?)
  for i, (where, row) in enumerate(rows):
    answers = row.get("answers") if isinstance(row, dict) else None
    text = row.get("question") if isinstance(row, dict) else None
    if not isinstance(text, str) or not text.strip() or not answers:
      raise DataError(f"{where} needs a non-empty 'question' and a non-empty 'answers' list")
    made = row.get("id") is None or row.get("id") == ""
    question = Question(str(i if made else row["id"]), text, _answer_texts(answers, where))
    if not valid_unicode(question.id, question.question, *question.answers):
      raise DataError(f"{where}: invalid Unicode (a lone surrogate) in its id, question or "
                      "answers")
    if question.id in seen:
      raise DataError(_duplicate(question.id, where, made, *seen[question.id]))
    seen[question.id] = where, made
    questions.append(question)
  return _nonempty(path, questions)


def _duplicate(qid: str, where: str, made: bool, first: str, first_made: bool) -> str:
  """The error for a question id seen before at `first`; says which of the two was made from a
  record number (a record without an id) rather than given."""
  if made or first_made:
    nameless, named = ("this record", first) if made else (first, "this record")
    return (f"{where}: duplicate question id {qid!r}: {nameless} has no 'id' and was given its "
            f"0-based record number, which {named} has as its 'id'; give every question an 'id'")
  return f"{where}: duplicate question id {qid!r} (also at {first})"


def _jsonl_rows(path: pathlib.Path) -> list[tuple[str, object]]:
  """(path:line, record) of a JSONL file's non-blank lines (lines end at \n only: a JSON string
  may hold U+2028 and other characters `str.splitlines` would split at)."""
  try:
    text = path.read_text(encoding="utf-8-sig")  # (a byte-order mark may open the file)
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 (byte {e.start}: {e.reason})") from None
  rows = []
  for number, line in enumerate(text.split("\n"), 1):
    if line.strip():
      try:
        rows.append((f"{path}:{number}", json.loads(line)))
      except JSON_ERRORS as e:  # (also a huge integer, deep nesting)
        raise DataError(f"{path}:{number}: {json_problem(e)}") from None
  return rows


def _nonempty(path: pathlib.Path, questions: list[Question]) -> list[Question]:
  if not questions:
    raise DataError(f"{path}: no questions")
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
