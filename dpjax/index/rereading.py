"""Re-reading (`index.reread`): a search's top passages encoded again by the phrase encoder and
every span of theirs scored exactly, for an index whose scores are approximate (a compact index's
codes) or whose phrases use the filter's kept tokens only.

A search ranks its candidate spans as before (dense, or fused with BM25); the passages of its
first R distinct spans are encoded with the dump's windows and dtype (the dump's own vectors, up
to the encoder's rounding), every token of theirs scored as a start and as an end as an
exhaustive search scores them (`hybrid.lexical_spans`), fused with the same BM25 terms, and these
spans replace those passages' spans (`rerank`). Each passage costs one encoding (results/scale.md
times it); a passage read again (the next round or request of the same questions, another
hybrid weight) comes from a cache of the last ones read. With a `margin`, only the passages of
the spans ranked within it of the best are read, and none when the best leads the next span by
it (`top_passages`): a question the codes answer clearly costs no encoding.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Sequence

import numpy as np

from dpjax.data.tokenization import Tokenizer
from dpjax.errors import DumpError
from dpjax.index import hybrid
from dpjax.index.encode import encode_shard
from dpjax.index.manifest import DumpConfig, encoder_fingerprint
from dpjax.index.rescoring import Rescorer
from dpjax.index.units import count
from dpjax.models.densephrases import compute_dtype, with_compute_dtype
from dpjax.models.encoders import bound, call_widths, compile_ahead, phrase_calls
from dpjax.parallel import make_mesh, padded_rows

# The dump settings that decide a passage's windows and vectors: re-read with the dump's own.
_WINDOW_SETTINGS = ("max_seq_length", "doc_stride", "include_title", "min_context",
                    "compute_dtype", "batch_size")
# Tokens whose vectors the cache keeps (float16, 768 bytes each at d = 384: 384 MiB).
CACHE_TOKENS = 1 << 19


@dataclasses.dataclass(frozen=True)
class ReadTokens:
  """The tokens of one search's re-read passages, numbered from `first` on (after the index's
  own token ids): each one's passage row and [start, end) characters."""
  first: int
  passage: np.ndarray  # [M] passage rows
  char_spans: np.ndarray  # [M, 2]


class Rereader:
  """Encodes passages for re-reading: `passages` per question, with the dump's windows and
  compute dtype (`dump_manifest`'s settings), by the model that made the dump.

  Args:
    model: the DensePhrases model whose phrase encoder made the dump (its fingerprint is
      checked).
    tokenizer: the dump's tokenizer.
    dump_manifest: the dump's manifest (its settings and fingerprint).
    passages: how many top passages of a question are re-read (>= 1).
    margin: None, or a score difference >= 0: of those passages only the ones holding a span
      ranked within `margin` of the best are read, none when the best leads the next span by
      at least `margin` (`top_passages`).
    cache_tokens: the most tokens whose vectors are kept for the next searches.
  """

  def __init__(self, model, tokenizer: Tokenizer, dump_manifest: dict, passages: int, *,
               margin: float | None = None, mesh=None, cache_tokens: int = CACHE_TOKENS):
    self.passages = count(passages, "index.reread (passages re-read per question)")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or math.isnan(margin) or margin < 0):
      raise ValueError(f"index.reread_margin = {margin!r}: must be a number >= 0 (or None)")
    self.margin = None if margin is None else float(margin)
    if encoder_fingerprint(model) != dump_manifest["fingerprint"]:
      raise DumpError("re-reading needs the model that made the dump (its phrase encoder's "
                      "fingerprint differs): dump the corpus again with this model")
    settings = dump_manifest["settings"]
    self.config = DumpConfig(**{k: settings[k] for k in _WINDOW_SETTINGS if k in settings},
                             width_multiple=dump_manifest.get("width_multiple", 0))
    self.tokenizer, self.mesh = tokenizer, mesh or make_mesh(local=True)
    model = with_compute_dtype(model, self.config.compute_dtype or compute_dtype(model))
    self._encode = bound(model, "phrases_and_filter")
    self.cache_tokens = cache_tokens
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._cached = 0  # tokens in the cache
    self._lock = threading.Lock()
    self.encoded_passages = 0  # passages encoded so far (the cache's misses)

  def read(self, rows: Sequence[int], passages) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per passage row of `rows` (rows of `passages`, the index's passage table), (vectors
    [n, D] float16, character spans [n, 2]) of its n tokens; those not cached are encoded in
    one `encode_shard` call."""
    rows = [int(r) for r in rows]
    with self._lock:
      found = {r: self._cache[r] for r in dict.fromkeys(rows) if r in self._cache}
      for r in found:
        self._cache.move_to_end(r)
    missing = [r for r in dict.fromkeys(rows) if r not in found]
    if missing:
      # A few windows: calls padded to a power of two, not to the full rows a dump's are.
      shard = encode_shard(self.tokenizer, [passages[r] for r in missing], self.config,
                           self.mesh, self._encode, pad_last=False)
      bounds = np.searchsorted(shard["token_passage"], np.arange(len(missing) + 1))
      for i, r in enumerate(missing):
        found[r] = (shard["vectors"][bounds[i]:bounds[i + 1]],
                    shard["char_spans"][bounds[i]:bounds[i + 1]])
      with self._lock:
        self.encoded_passages += len(missing)
        for r in missing:
          self._keep(r, found[r])
    return [found[r] for r in rows]

  def compile(self) -> int:
    """Compiles the phrase encoder for every call a re-reading makes (each power-of-two rows up
    to a call's, each width), in threads: a search then compiles nothing. Returns the shapes."""
    rows, multiple = phrase_calls(self.config.batch_size, self.mesh, self.config.width_multiple)
    counts = sorted({padded_rows(n, rows, self.mesh) for n in range(1, rows + 1)})
    widths = call_widths(multiple, self.config.max_seq_length)
    return sum(compile_ahead(self._encode, count, widths, self.mesh) for count in counts)

  def clear(self) -> None:
    """Empties the cache (a timing of cold reads starts from it)."""
    with self._lock:
      self._cache.clear()
      self._cached = 0

  def _keep(self, row: int, entry: tuple[np.ndarray, np.ndarray]) -> None:
    """Caches a passage's vectors, the least recently read ones dropped past `cache_tokens`."""
    if row in self._cache:
      return
    self._cache[row] = entry
    self._cached += len(entry[0])
    while self._cached > self.cache_tokens and self._cache:
      self._cached -= len(self._cache.popitem(last=False)[1][0])


def top_passages(passage_rows: np.ndarray, count: int, scores: np.ndarray | None = None,
                 margin: float | None = None) -> np.ndarray:
  """The first `count` distinct passage rows of ranked spans' passages (best first). With a
  `margin`, of the spans scoring (`scores`, best first) less than `margin` below the best only:
  none when the best is the only one (it leads the next span by `margin` or more)."""
  if margin is not None:
    within = int(np.count_nonzero(scores > scores[0] - margin)) if len(scores) else 0
    passage_rows = passage_rows[:within] if within > 1 else passage_rows[:0]
  rows = np.unique(passage_rows, return_index=True)
  return rows[0][np.argsort(rows[1])][:count].astype(np.int64)


def read_spans(rereader: Rereader, passages, q_start: np.ndarray, q_end: np.ndarray,
               picks: Sequence[np.ndarray], max_answer_length: int, first: int
               ) -> tuple[ReadTokens, list[tuple[np.ndarray, ...]]]:
  """The re-read passages `picks` (rows per question) of questions [Q, D]: their tokens
  (`ReadTokens`, numbered from `first`) and per question (starts, ends, exact scores) of every
  distinct best span of their tokens (`hybrid.lexical_spans`), in those token ids."""
  rows = list(dict.fromkeys(int(r) for pick in picks for r in pick))
  if not rows:  # (an index without tokens ranks no span)
    empty = np.zeros(0, np.int64)
    return (ReadTokens(first, empty, np.zeros((0, 2), np.int32)),
            [(empty, empty, np.zeros(0, np.float32)) for _ in picks])
  read = rereader.read(rows, passages)
  sizes = np.array([len(vectors) for vectors, _ in read], np.int64)
  local = {r: i for i, r in enumerate(rows)}
  vectors = np.concatenate([v for v, _ in read])
  spans = np.concatenate([s for _, s in read])
  token_passage = np.repeat(np.arange(len(rows)), sizes)
  rescorer = Rescorer(vectors, token_passage, len(rows))
  found = hybrid.lexical_spans(rescorer, q_start, q_end,
                               [np.array([local[int(r)] for r in pick], np.int64)
                                for pick in picks], max_answer_length)
  out = []
  for starts, ends, scores in found:
    keys, at = np.unique(starts * max(len(token_passage), 1) + ends, return_index=True)
    at = at[np.argsort(-scores[at], kind="stable")]
    out.append((starts[at] + first, ends[at] + first, scores[at]))
  tokens = ReadTokens(first, np.asarray(rows, np.int64)[token_passage], spans)
  return tokens, out


def rerank(ranked: tuple[np.ndarray, ...], ranked_passages: np.ndarray, picks: np.ndarray,
           read: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
  """Ranked spans (starts, ends, scores) with the spans of passages `picks` replaced by their
  re-read spans `read` (fused scores); `ranked_passages`: the passage row of each ranked span.

  The re-read spans are placed on the ranking's scale: the best of them takes the best score
  the ranking gave those passages' spans and the others keep their differences to it, so the
  re-read passages are ordered among themselves by their exact scores while the other spans
  keep their places between them (a best coded score, the maximum of noisy estimates, runs
  higher than the exact one: compared as they are, every re-read passage would sink)."""
  picked = np.isin(ranked_passages, picks)
  if not picked.any() or not len(read[0]):
    return ranked
  scores = read[2] - read[2].max() + ranked[2][picked].max()
  starts = np.concatenate([read[0], ranked[0][~picked]])
  ends = np.concatenate([read[1], ranked[1][~picked]])
  scores = np.concatenate([scores, ranked[2][~picked]]).astype(np.float32)
  order = np.argsort(-scores, kind="stable")  # ties: the re-read span first
  return starts[order], ends[order], scores[order]
