"""A thin wrapper over a Hugging Face fast tokenizer: ids and character offsets, no padding.

The wrapper never pads or truncates (the bundled MiniLM `tokenizer.json` pads and truncates at 128
tokens; both are switched off here): windowing and padding are the feature builders' job.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Sequence

import numpy as np
import regex as unicode_regex
import tokenizers

from dpjax.io import digest_texts
from dpjax.model_files import DEFAULT_MODEL, resolve_model_dir


class Tokenizer:
  """Word-piece tokenizer returning token ids with (start, end) character offsets."""

  def __init__(self, backend: tokenizers.Tokenizer):
    backend.no_padding()
    backend.no_truncation()
    self.backend = backend
    ids = {tok: backend.token_to_id(tok) for tok in ("[CLS]", "[SEP]", "[PAD]", "[UNK]")}
    missing = [tok for tok, i in ids.items() if i is None]
    if missing:
      raise ValueError(f"tokenizer vocabulary lacks the special tokens {missing}")
    self.cls_id, self.sep_id, self.pad_id, self.unk_id = (
        ids["[CLS]"], ids["[SEP]"], ids["[PAD]"], ids["[UNK]"])

  @classmethod
  def from_pretrained(cls, name: str | os.PathLike = DEFAULT_MODEL) -> "Tokenizer":
    """Loads `tokenizer.json`, or builds a BERT word-piece tokenizer from `vocab.txt`."""
    model_dir = resolve_model_dir(name)
    if (model_dir / "tokenizer.json").is_file():
      return cls(tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    if (model_dir / "vocab.txt").is_file():
      lowercase = _do_lower_case(model_dir)
      wordpiece = tokenizers.BertWordPieceTokenizer(str(model_dir / "vocab.txt"),
                                                    lowercase=lowercase)
      return cls(tokenizers.Tokenizer.from_str(wordpiece.to_str()))  # (its public form)
    raise FileNotFoundError(f"{model_dir}: neither tokenizer.json nor vocab.txt found")

  @functools.cached_property
  def fingerprint(self) -> str:
    """A short hash of the whole tokenizer (vocabulary, normalizer, pre-tokenizer, ...)."""
    return digest_texts(self.backend.to_str())

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size()

  def tokenize(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tokenizes texts without special tokens.

    Returns:
      For each text, `(ids [T] int32, offsets [T, 2] int32)`: token ids and the character span
      `text[start:end]` each token came from.
    """
    texts = list(texts)
    encodings = self.backend.encode_batch(texts, add_special_tokens=False)
    return [(np.asarray(e.ids, dtype=np.int32),
             _over_marks(text, np.asarray(e.offsets, dtype=np.int32).reshape(-1, 2)))
            for text, e in zip(texts, encodings)]

  def encode(self, texts: Sequence[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Encodes single-segment inputs `[CLS] text [SEP]`, truncated to `max_length`.

    Returns:
      input_ids [N, max_length] int32 (padded with the pad id) and attention_mask [N, max_length].
    """
    if max_length < 2:
      raise ValueError(f"max_length must be >= 2, got {max_length}")
    ids = np.full((len(texts), max_length), self.pad_id, dtype=np.int32)
    mask = np.zeros((len(texts), max_length), dtype=np.int32)
    for row, (tokens, _) in enumerate(self.tokenize(texts)):
      tokens = np.concatenate([[self.cls_id], tokens[:max_length - 2], [self.sep_id]])
      ids[row, :len(tokens)] = tokens
      mask[row, :len(tokens)] = 1
    return ids, mask


def _do_lower_case(model_dir: pathlib.Path) -> bool:
  config = model_dir / "tokenizer_config.json"
  if config.is_file():
    return bool(json.loads(config.read_text(encoding="utf-8")).get("do_lower_case", True))
  return True


_MARKS = unicode_regex.compile(r"\p{M}+")  # combining marks (accents, viramas, ...)


def _over_marks(text: str, offsets: np.ndarray) -> np.ndarray:
  """`offsets` with each token's end moved past the combining marks right after it that no token
  holds: an uncased tokenizer strips accents, so "Cafe\u0301" ends its token before the accent,
  and an answer cut at that end lost it (no exact match with "Café")."""
  if text.isascii() or not len(offsets):
    return offsets
  runs = np.array([m.span() for m in _MARKS.finditer(text)], np.int64).reshape(-1, 2)
  ends = offsets[:, 1]
  if not len(runs) or (np.diff(ends) < 0).any():  # (word pieces' offsets are in order)
    return offsets
  # One pass for all runs (a script with a mark in every syllable has hundreds a passage): the
  # run starting where a token ends, and whether a token holds part of that run (the first
  # token ending after the run's start begins before its end).
  run = np.minimum(np.searchsorted(runs[:, 0], ends), len(runs) - 1)
  after = np.searchsorted(ends, runs[:, 0], side="right")
  held = (after < len(ends)) & (offsets[np.minimum(after, len(ends) - 1), 0] < runs[:, 1])
  extend = (runs[run, 0] == ends) & ~held[run]
  offsets[extend, 1] = runs[run[extend], 1]
  return offsets
