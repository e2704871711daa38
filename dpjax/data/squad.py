"""SQuAD-format reading-comprehension data: reading, validation, and fixed-shape features.

`read_squad(path)` parses a SQuAD v1.1-format file (`data[].title`, `data[].paragraphs[].context`,
`paragraphs[].qas[].{id, question, answers[].{text, answer_start}}`) into passages and questions.
Bad records are skipped and counted by reason in a `SkipSummary` (a question without `answers`, an
answer text that is neither at `answer_start` nor anywhere in the context, an empty context, ...);
a file that is empty, not UTF-8, not JSON or not shaped like SQuAD raises `DataError` naming the
file and, for JSON errors, the line and column.

`build_features(...)` turns them into numpy arrays of fixed shape:
  - passage windows (`dpjax.data.windows`, as the dump's);
  - questions `[CLS] question [SEP]` of `max_query_length` tokens;
  - features: (question, window, start token, end token); a window that does not contain the
    whole answer targets [CLS] (position 0).

Command line: `python -m dpjax.data.squad FILE [--max-seq-length 384 ...]` prints the counts.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import pathlib
import sys
from typing import Any, Iterable, Sequence

import numpy as np

from dpjax.data.tokenization import Tokenizer
from dpjax.data.windows import PassageWindows, build_windows
from dpjax.errors import ConfigError, DataError
from dpjax.io import write_json

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Passage:
  """A passage of a corpus or of a reading-comprehension file (one type for both)."""
  id: str
  title: str
  text: str

  @property
  def context(self) -> str:
    """SQuAD's name for the text."""
    return self.text


@dataclasses.dataclass
class Question:
  """A question with its gold answers: of a reading-comprehension file (with the passage and
  answer offset) or an open-domain one (`dpjax.data.questions`; title: the gold document's, if
  known)."""
  id: str
  question: str
  answers: list[str]  # all gold answer texts (for evaluation), first usable one first
  answer_start: int = -1  # character offset of answers[0] in the passage, -1 for open questions
  passage_index: int = -1  # row of its passage in the file's passages, -1 for open questions
  title: str = ""


@dataclasses.dataclass
class SkipSummary:
  """Counts of skipped records by reason, with the location of the first few of each."""

  path: str = ""
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  questions_seen: int = 0
  answers_relocated: int = 0  # answer text not at answer_start but found elsewhere: kept

  def skip(self, reason: str, where: str, n: int = 1) -> None:
    self.counts[reason] += n
    self.examples.setdefault(reason, [])
    if len(self.examples[reason]) < 3:
      self.examples[reason].append(where)

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def __str__(self) -> str:
    lines = [f"{self.path}: skipped {self.total} record(s)"]
    for reason, n in sorted(self.counts.items()):
      lines.append(f"  {reason}: {n} (e.g. {'; '.join(self.examples[reason])})")
    if self.answers_relocated:
      lines.append(f"  (kept, answer found away from answer_start: {self.answers_relocated})")
    return "\n".join(lines)


# What `json.loads` raises on bad text besides `json.JSONDecodeError` (a ValueError): ValueError
# for an integer of more than 4,300 digits, RecursionError for nesting past the recursion limit.
JSON_ERRORS = (ValueError, RecursionError)


def json_problem(error: BaseException) -> str:
  """One line on why `json.loads` refused a text (`JSON_ERRORS`)."""
  if isinstance(error, json.JSONDecodeError):
    return f"invalid JSON at column {error.colno}: {error.msg}"
  if isinstance(error, RecursionError):
    return "invalid JSON: nested too deeply"
  return f"invalid JSON: {str(error)[:200]}"


def load_json(path: str | os.PathLike) -> Any:
  """Reads a JSON file; every failure is a `DataError` naming the file and the position."""
  try:
    raw = open(path, "rb").read()
  except OSError as e:
    raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
  if not raw.strip():
    raise DataError(f"{path}: file is empty")
  try:
    text = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
                    ) from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    hint = (" (one JSON value per line? JSON Lines files are read as such when named .jsonl)"
            if e.msg == "Extra data" else "")
    raise DataError(f"{path}: invalid JSON at line {e.lineno} column {e.colno} "
                    f"(char {e.pos}): {e.msg}{hint}") from None
  except JSON_ERRORS as e:
    raise DataError(f"{path}: {json_problem(e)}") from None


def write_squad_subset(src: str | os.PathLike, dst: str | os.PathLike,
                       question_ids: Iterable[str]) -> int:
  """Writes the questions `question_ids` of SQuAD file `src` (with their paragraphs only) to `dst`
  in the same format; returns how many were found (all of them, or a `DataError`). Ids match as
  `read_squad` reads them (a number as its text; of repeated ids the first); records it skips
  (not objects, no 'qas' list) are left out."""
  wanted = set(question_ids)
  root = load_json(src)
  if not isinstance(root, dict) or not isinstance(root.get("data"), list):
    raise DataError(f"{src}: expected a JSON object with a 'data' list (SQuAD format)")
  articles, found = [], set()
  for article in root["data"]:
    paragraphs = []
    for paragraph in _objects(article.get("paragraphs") if isinstance(article, dict) else None):
      qas = []
      for qa in _objects(paragraph.get("qas")):
        qid = None if qa.get("id") is None else str(qa["id"])
        if qid in wanted and qid not in found:
          qas.append(qa)
          found.add(qid)
      if qas:
        paragraphs.append({**paragraph, "qas": qas})
    if paragraphs:
      articles.append({**article, "paragraphs": paragraphs})
  if len(found) != len(wanted):
    raise DataError(f"{src}: {len(wanted) - len(found)} of {len(wanted)} question ids not found "
                    f"(e.g. {sorted(wanted - found)[0]!r})")
  dst = pathlib.Path(dst)
  dst.parent.mkdir(parents=True, exist_ok=True)
  subset = {**root, "data": articles}
  try:
    write_json(dst, subset, indent=None, ensure_ascii=False)
  except UnicodeEncodeError:  # a lone surrogate (e.g. "\ud800") in a kept field: left escaped
    write_json(dst, subset, indent=None)
  return len(found)


def _objects(items: Any) -> list[dict]:
  """The JSON objects of a list (anything else: none)."""
  return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def read_squad(path: str | os.PathLike, *, require_answers: bool = True,
               ) -> tuple[list[Passage], list[Question], SkipSummary]:
  """Reads a SQuAD-format file into passages and questions, skipping and counting bad records.

  Args:
    path: the JSON file.
    require_answers: when True (reading comprehension), a question needs at least one answer
      whose text occurs in its context; when False, questions without answers are kept.

  Returns:
    (passages, questions, summary). Passages without questions are kept (a corpus file).
  """
  root = load_json(path)
  if not isinstance(root, dict) or not isinstance(root.get("data"), list):
    raise DataError(f"{path}: expected a JSON object with a 'data' list (SQuAD format)")
  summary = SkipSummary(path=str(path))
  passages, questions, seen_ids = [], [], set()
  for a, article in enumerate(root["data"]):
    where = f"data[{a}]"
    if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
      summary.skip("article without a 'paragraphs' list", where)
      continue
    title = title_text(article.get("title"))
    for p, paragraph in enumerate(article["paragraphs"]):
      pwhere = f"{where}.paragraphs[{p}]"
      qas = paragraph.get("qas", []) if isinstance(paragraph, dict) else []
      if not isinstance(qas, list):  # (e.g. one question object not in a list)
        summary.questions_seen += 1
        summary.skip("'qas' is not a list", pwhere)
        qas = []
      summary.questions_seen += len(qas)
      context = paragraph.get("context") if isinstance(paragraph, dict) else None
      if isinstance(context, str) and not valid_unicode(context, title):
        summary.skip("invalid Unicode (a lone surrogate) in a context or title", pwhere)
        if qas:
          summary.skip("question in a paragraph with invalid Unicode", pwhere, len(qas))
        continue
      if not isinstance(context, str) or not context.strip():
        reason = "paragraph without 'context'" if not isinstance(context, str) else "empty context"
        summary.skip(reason, pwhere)
        if qas:
          summary.skip(f"question in a paragraph with {reason}", pwhere, len(qas))
        continue
      passage_index = len(passages)
      pid = paragraph.get("id") or f"{pathlib.Path(path).stem}-{a}-{p}"
      passages.append(Passage(str(pid), title, context))
      for q, qa in enumerate(qas):
        question = _read_question(qa, context, passage_index, f"{pwhere}.qas[{q}]",
                                  require_answers, summary)
        if question is not None and question.id in seen_ids:
          summary.skip("duplicate question id (the first one is kept)",
                       f"{pwhere}.qas[{q}] (id={question.id})")
        elif question is not None:
          seen_ids.add(question.id)
          questions.append(question)
  return passages, questions, summary


def title_text(value: Any) -> str:
  """A record's title: a string (a number as its text); missing, null or anything else: ''
  (one rule for every reader: gold passages are matched by title and text)."""
  if isinstance(value, str):
    return value
  return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def valid_unicode(*texts: str) -> bool:
  """False for text a tokenizer cannot take (a lone surrogate, e.g. from a JSON `\\ud800`)."""
  try:
    for text in texts:
      text.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _read_question(qa: Any, context: str, passage_index: int, where: str,
                   require_answers: bool, summary: SkipSummary) -> Question | None:
  if not isinstance(qa, dict):
    summary.skip("question record is not an object", where)
    return None
  qid, text = qa.get("id"), qa.get("question")
  where = f"{where} (id={qid})"
  if qid is None or not isinstance(text, str) or not text.strip():
    summary.skip("question without 'id' or 'question'", where)
    return None
  if not valid_unicode(text, str(qid)):
    summary.skip("invalid Unicode (a lone surrogate) in a question", where)
    return None
  answers = qa.get("answers")
  if not isinstance(answers, list) or (require_answers and not answers):
    if require_answers:
      summary.skip("question without 'answers'", where)
      return None
    answers = []
  located, relocated, texts = None, None, []
  for answer in answers:
    answer_text = answer.get("text") if isinstance(answer, dict) else answer
    if not isinstance(answer_text, str) or not answer_text.strip():
      continue
    texts.append(answer_text)
    if located is None and isinstance(answer, dict):
      start = _offset(answer.get("answer_start"))
      if start >= 0 and context[start:start + len(answer_text)] == answer_text:
        located = (answer_text, start)  # the first answer at its own answer_start
      elif relocated is None and (found := context.find(answer_text)) >= 0:
        relocated = (answer_text, found)  # else the first found anywhere
  if located is None and relocated is not None:
    located = relocated
    summary.answers_relocated += 1
  if require_answers and located is None:
    summary.skip("answer not in context" if texts else "answers without text", where)
    return None
  if located is not None:  # the usable answer first, then the other gold texts
    texts = [located[0]] + [t for t in texts if t != located[0]]
  return Question(id=str(qid), question=text, answers=texts,
                  answer_start=located[1] if located else -1, passage_index=passage_index)


def _offset(value: Any) -> int:
  """A character offset given as an int or an integral float (e.g. 28.0 from pandas); -1 for
  anything else, a negative value included (it would slice from the end)."""
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


@dataclasses.dataclass
class RCFeatures:
  """Windows, questions, and (question, window, answer span) features."""

  windows: PassageWindows
  question_input_ids: np.ndarray  # [Q, Lq] int32
  question_attention_mask: np.ndarray  # [Q, Lq] int32
  question_index: np.ndarray  # [N] int32
  window_index: np.ndarray  # [N] int32
  start_position: np.ndarray  # [N] int32, 0 ([CLS]) when the window lacks the answer
  end_position: np.ndarray  # [N] int32

  def __len__(self) -> int:
    return len(self.question_index)


def answer_token_span(offsets: np.ndarray, char_start: int, char_end: int) -> tuple[int, int]:
  """Token indices (first, last) covering characters [char_start, char_end) of a context.

  Args:
    offsets: [T, 2] character offsets of the context tokens.
  Returns:
    (-1, -1) when no token overlaps the span.
  """
  first = int(np.searchsorted(offsets[:, 1], char_start, side="right"))  # first ending after
  last = int(np.searchsorted(offsets[:, 0], char_end, side="left")) - 1  # last starting before
  if first >= len(offsets) or last < first:
    return -1, -1
  return first, last


def build_features(tokenizer: Tokenizer, passages: Sequence[Passage],
                   questions: Sequence[Question], *, max_seq_length: int = 384,
                   doc_stride: int = 128, max_query_length: int = 64,
                   include_title: bool = True) -> RCFeatures:
  """Builds windows, tokenised questions, and one feature per (question, window of its passage)."""
  windows, passage_offsets = build_windows(tokenizer, passages, max_seq_length=max_seq_length,
                                           doc_stride=doc_stride, include_title=include_title)
  q_ids, q_mask = tokenizer.encode([q.question for q in questions], max_query_length)
  windows_of = collections.defaultdict(list)
  for w, p in enumerate(windows.passage_index.tolist()):
    windows_of[p].append(w)
  cols = collections.defaultdict(list)
  for qi, question in enumerate(questions):
    span = (-1, -1)
    if question.answer_start >= 0:
      span = answer_token_span(passage_offsets[question.passage_index], question.answer_start,
                               question.answer_start + len(question.answers[0]))
    for w in windows_of[question.passage_index]:
      first_context = int(np.argmax(windows.context_mask[w]))
      lo = windows.token_offset[w]
      hi = lo + int(windows.context_mask[w].sum())
      inside = span[0] >= lo and 0 <= span[1] < hi
      cols["q"].append(qi)
      cols["w"].append(w)
      cols["s"].append(span[0] - lo + first_context if inside else 0)
      cols["e"].append(span[1] - lo + first_context if inside else 0)
  as_array = lambda key: np.asarray(cols[key], dtype=np.int32)
  return RCFeatures(windows, q_ids, q_mask, as_array("q"), as_array("w"), as_array("s"),
                    as_array("e"))


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("path", help="SQuAD-format JSON file")
  parser.add_argument("--model", default="minilm-l6", help="tokenizer: directory or model name")
  parser.add_argument("--max-seq-length", type=int, default=384)
  parser.add_argument("--doc-stride", type=int, default=128)
  parser.add_argument("--max-query-length", type=int, default=64)
  parser.add_argument("--no-title", action="store_true", help="do not prefix the title")
  args = parser.parse_args(argv)
  if args.max_query_length < 2:
    parser.error(f"--max-query-length {args.max_query_length}: a question is at least [CLS] [SEP]"
                 " (2)")
  try:
    passages, questions, summary = read_squad(args.path)
    features = build_features(Tokenizer.from_pretrained(args.model), passages, questions,
                              max_seq_length=args.max_seq_length, doc_stride=args.doc_stride,
                              max_query_length=args.max_query_length,
                              include_title=not args.no_title)
  except (DataError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  answerable = int((features.start_position > 0).sum())
  skipped_q = summary.questions_seen - len(questions)
  print(f"file: {args.path}")
  print(f"questions read: {summary.questions_seen}, kept: {len(questions)}, "
        f"skipped: {skipped_q} ({100 * skipped_q / max(summary.questions_seen, 1):.3f}%)")
  print(f"passages: {len(passages)}, windows: {len(features.windows)} "
        f"(max_seq_length {args.max_seq_length}, doc_stride {args.doc_stride})")
  print(f"features: {len(features)} (answer inside the window: {answerable})")
  print(summary)
  return 0


if __name__ == "__main__":
  sys.exit(main())
