"""Retrieval units (phrase, sentence, passage, document): a retrieved `Phrase`, the sentences of
a passage, a passage's document, and the checks of a search request.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

UNITS = ("phrase", "sentence", "passage", "document")
# A sentence ends at . ! or ? (and any closing quotes or brackets) followed by whitespace and a
# character that is not a lower-case letter, unless the period ends an abbreviation or an initial.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)\]]*\s+(?=[^\s])")
_ABBREVIATION = re.compile(
    r"(?:^|[\s(\"'])(?:[A-Za-z]|Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|Mt|Ft|Gen|Col|Lt|Sgt|Capt|Rev|Gov|"
    r"Sen|Rep|No|Nos|vs|etc|e\.g|i\.e|Inc|Ltd|Co|Corp|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|"
    r"Oct|Nov|Dec|U\.S|U\.K|a\.m|p\.m)\.$")


@dataclasses.dataclass
class Phrase:
  score: float
  # The index's token ids; a re-read span's are ids past them (`rereading.ReadTokens`), which
  # name its tokens within the search that found it only.
  start_token: int
  end_token: int
  passage: int  # row in the dump's passage table
  start_char: int
  end_char: int
  text: str
  # Lower-scoring spans overlapping this one, merged into it (`index.merge_spans`), best first.
  merged: list = dataclasses.field(default_factory=list)


def sentence_bounds(text: str) -> list[int]:
  """Character offsets [0, ends..., len(text)] of the sentences of `text` (`_SENTENCE_END`): a
  sentence ends at . ! ? followed by whitespace, then not by a lower-case letter, nor after an
  abbreviation ("Dr.", "e.g.", "U.S.") or an initial ("J."); the whitespace goes with it."""
  ends = [m.end() for m in _SENTENCE_END.finditer(text)
          if not text[m.end()].islower()
          and not (text[m.start() - 1] == "." and _ABBREVIATION.search(text, 0, m.start()))]
  return [0] + ends + [len(text)]


def document_key(passage) -> str | tuple[str, str]:
  """A passage's document: its title (the passages of one title), or ("id", its id) for an
  untitled passage alone (a tuple: an id equal to another passage's title is another document)."""
  return passage.title if passage.title else ("id", passage.id)


def check_request(k: int, unit: str) -> int:
  """Refuses a unit not in UNITS and a k below 1 (faiss would fail on it without a message);
  returns k as a Python int (faiss refuses numpy integers)."""
  if unit not in UNITS:
    raise ValueError(f"unknown retrieval unit {unit!r}; one of {UNITS}")
  return count(k, "k (the number of results)")


def count(value, name: str) -> int:
  """`value` as a Python int, or a ValueError naming it unless an integer >= 1."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be >= 1 (an integer), got {value!r}")
  return int(value)
