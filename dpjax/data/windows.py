"""Passage windows: `[CLS] title [SEP] context-window [SEP]` of `max_seq_length` tokens, cut from
long contexts every `doc_stride` tokens (or as few as keep `min_context` tokens of context around
every token), with the character span of every context token. Made for any corpus: the dump's
windows, and the reading-comprehension features' (`squad.build_features`).

Passages are any objects with `title` and `text` (`squad.Passage`, `corpus.read_corpus`'s).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from dpjax.data.tokenization import Tokenizer
from dpjax.errors import ConfigError


@dataclasses.dataclass
class PassageWindows:
  """Fixed-length token windows over passages. Arrays are [W, L] unless noted."""

  input_ids: np.ndarray  # int32, [CLS] title [SEP] context [SEP], pad id after
  attention_mask: np.ndarray  # int32 {0, 1}
  context_mask: np.ndarray  # bool: the token comes from the context (a phrase boundary)
  is_max_context: np.ndarray  # bool: this window gives the token its most context
  char_start: np.ndarray  # int32: context[char_start:char_end] is the token's text; -1 if none
  char_end: np.ndarray  # int32
  passage_index: np.ndarray  # [W] int32
  token_offset: np.ndarray  # [W] int32: index of the window's first context token in the passage

  def __len__(self) -> int:
    return len(self.passage_index)


def build_windows(tokenizer: Tokenizer, passages: Sequence, *, max_seq_length: int,
                  doc_stride: int, include_title: bool = True, max_title_length: int = 32,
                  min_context: int = 0) -> tuple[PassageWindows, list[np.ndarray]]:
  """Cuts every passage into windows of `max_seq_length` tokens, every `doc_stride` tokens.

  With `min_context` > 0 (the dump's choice), windows are as far apart as still gives every
  token at least `min_context` tokens of context on each side inside its max-context window
  (where the passage has them; never closer than `doc_stride`): fewer tokens re-encoded.

  Returns:
    The windows, and for each passage the [T, 2] character offsets of all its context tokens
    (used to map answers to token positions).
  """
  contexts = tokenizer.tokenize([p.text for p in passages])
  titles = (tokenizer.tokenize([p.title for p in passages]) if include_title
            else [(np.zeros(0, np.int32), None)] * len(passages))
  rows = []
  for index, ((ids, offsets), (title_ids, _)) in enumerate(zip(contexts, titles)):
    prefix = [tokenizer.cls_id]
    if include_title and len(title_ids):
      prefix += list(title_ids[:max_title_length]) + [tokenizer.sep_id]
    room = max_seq_length - len(prefix) - 1
    if room < 1 or doc_stride < 1:
      raise ConfigError(f"data.max_seq_length {max_seq_length} leaves no room for context "
                        f"(prefix {len(prefix)} tokens) or doc_stride {doc_stride} < 1")
    starts = _window_starts(len(ids), room, doc_stride, min_context)
    for start in starts:
      end = min(start + room, len(ids))
      rows.append((index, start, end, prefix, ids[start:end], offsets[start:end]))
  windows = _pack_windows(rows, contexts, max_seq_length, tokenizer.pad_id,
                          tokenizer.sep_id)
  return windows, [offsets for _, offsets in contexts]


# Worker processes that make windows ahead of the dump's encoder
# (`dpjax.index.window_maker.WindowMaker`) run these: a spawned process imports only this module's
# dependencies, no JAX.
_WORKER: dict = {}


def windows_worker_setup(tokenizer: Tokenizer, settings: dict, started=None) -> None:
  _WORKER.update(tokenizer=tokenizer, settings=settings, started=started)


def windows_worker(passages: Sequence) -> PassageWindows:
  return build_windows(_WORKER["tokenizer"], passages, **_WORKER["settings"])[0]


def windows_worker_ready() -> int:
  """A worker's first task when the workers are started ahead of their work: its process id,
  once every worker has started (the `started` event set): while these tasks wait, no worker is
  idle, so the pool starts a new process for each of them."""
  if _WORKER.get("started") is not None:
    _WORKER["started"].wait(60)
  return os.getpid()


def _window_starts(length: int, room: int, doc_stride: int, min_context: int) -> list[int]:
  """First context token of each window of a passage of `length` tokens (see build_windows).

  With `min_context`, windows are `room - 2 min_context` apart (never closer than doc_stride):
  neighbours overlap by 2 min_context, so the max-context rule leaves every token that much
  context; the last window ends with the passage, so no token is encoded more than needed."""
  stride = max(room - 2 * min_context, doc_stride) if min_context > 0 else doc_stride
  stride = min(stride, room)  # a stride past the room would skip tokens (HF: min(length, stride))
  starts = list(range(0, max(length - room, 0) + stride, stride))
  return [s for s in starts if s < max(length, 1)]  # one (empty) window if no tokens


def _pack_windows(rows, contexts, max_seq_length: int, pad_id: int, sep_id: int,
                  ) -> PassageWindows:
  n = len(rows)
  shape = (n, max_seq_length)
  input_ids = np.full(shape, pad_id, np.int32)
  attention_mask = np.zeros(shape, np.int32)
  context_mask = np.zeros(shape, bool)
  char_start, char_end = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
  passage_index, token_offset = np.zeros(n, np.int32), np.zeros(n, np.int32)
  # A token's "max context" window is the one where min(left, right) context is largest
  # (the rule of BERT's run_squad), so each token is scored and indexed once.
  is_max_context = np.zeros(shape, bool)
  best_score = [np.full(len(ids), -1.0) for ids, _ in contexts]
  best_window = [np.zeros(len(ids), np.int64) for ids, _ in contexts]
  for w, (p, start, end, prefix, ids, offsets) in enumerate(rows):
    k = len(prefix)
    row = np.concatenate([prefix, ids, [sep_id]])
    input_ids[w, :len(row)] = row
    attention_mask[w, :len(row)] = 1
    context_mask[w, k:k + len(ids)] = True
    char_start[w, k:k + len(ids)] = offsets[:, 0]
    char_end[w, k:k + len(ids)] = offsets[:, 1]
    passage_index[w], token_offset[w] = p, start
    t = np.arange(start, end)
    score = np.minimum(t - start, end - 1 - t) + 0.01 * (end - start)
    better = score > best_score[p][start:end]
    best_score[p][start:end][better] = score[better]
    best_window[p][start:end][better] = w
  for w, (p, start, end, prefix, _, _) in enumerate(rows):
    is_max_context[w, len(prefix):len(prefix) + end - start] = best_window[p][start:end] == w
  return PassageWindows(input_ids, attention_mask, context_mask, is_max_context, char_start,
                        char_end, passage_index, token_offset)
