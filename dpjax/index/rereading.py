"""Re-reading (`index.reread`): a search's top passages encoded again by the phrase encoder and
every span of theirs scored exactly, for an index whose scores are approximate (a compact index's
codes) or whose phrases use the filter's kept tokens only.

A search ranks its candidate spans as before (dense, or fused with BM25), from 2 R spans on and
wider while they hold fewer than R passages (`wants_wider`); the first R passages of its spans are
encoded with the dump's windows and dtype (the dump's own vectors, up to the encoder's rounding),
every token of theirs scored as a start and as an end as an exhaustive search scores them
(`hybrid.lexical_spans`), fused with the same BM25 terms, and these spans replace those passages'
spans (`rerank`). Each passage costs one encoding (results/scale.md times it); a passage read again
(the next round or request of the same questions, another hybrid weight) comes from a cache of the
last ones read. With a `margin`, only the passages of the spans ranked within it of the best are
read, and none when the best leads the next span by it (`top_passages`): a question the codes
answer clearly costs no encoding. With a `window`, a passage longer than `window` word pieces is
read only around its best span (`window_of`): the encoding costs about the window's tokens, and the
window's spans replace the passage's. With a `questions` encoder of its own, the re-read spans are
scored by it, not by the question vectors that ranked the candidates: QSFT's encoder, tuned to an
index's codes, picks the passages, and the trained one, the phrase encoder's partner, scores them.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Callable, Sequence

import numpy as np

from dpjax.data.squad import Passage
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
    window: None, or the most word pieces of a passage read around its best span (`window_of`).
    cache_tokens: the most tokens whose vectors are kept for the next searches.
    questions: None (the re-read spans are scored with the search's question vectors), or
      texts -> (q_start, q_end) [Q, D] each: the question encoder that scores them, e.g. the
      trained one where a QSFT'd one ranks the candidates (`question_vectors`).
  """

  def __init__(self, model, tokenizer: Tokenizer, dump_manifest: dict, passages: int, *,
               margin: float | None = None, window: int | None = None, mesh=None,
               cache_tokens: int = CACHE_TOKENS,
               questions: Callable[[list[str]], tuple[np.ndarray, np.ndarray]] | None = None):
    self.passages = count(passages, "index.reread (passages re-read per question)")
    self.window = None if window is None else count(
        window, "index.reread_window (word pieces read around a passage's best span)")
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
    self.encoded_passages = 0  # passages (or parts) encoded so far (the cache's misses)
    self.encoded_tokens = 0  # their tokens
    self.questions = questions
    self._asked: tuple | None = None  # (texts, their vectors) of the last `question_vectors`

  def question_vectors(self, texts: Sequence[str], q_start: np.ndarray, q_end: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The vectors that score the re-read spans of the questions `texts` whose search vectors
    are (q_start, q_end): those of this reader's `questions` encoder (the last texts' kept for
    their next search: a passage search after a phrase search), else the search's own."""
    if self.questions is None:
      return q_start, q_end
    if texts is None or isinstance(texts, str) or len(texts) != len(q_start):
      raise ValueError("re-reading with its own question encoder (index.reread_checkpoint) "
                       "needs the text of every question searched")
    key = tuple(texts)
    with self._lock:
      if self._asked is not None and self._asked[0] == key:
        return self._asked[1]
    vectors = self.questions(list(texts))
    with self._lock:
      self._asked = (key, vectors)
    return vectors

  def read(self, rows: Sequence, passages) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per item of `rows`, a passage row of `passages` (the index's passage table) or (row,
    (first, end) characters of the part of its text read: `window_of`), (vectors [n, D]
    float16, character spans [n, 2] in the passage's text) of its n tokens; those not cached
    are encoded in one `encode_shard` call."""
    keys = [(int(r), None) if np.isscalar(r) else (int(r[0]), r[1] and tuple(map(int, r[1])))
            for r in rows]
    with self._lock:
      found = {k: self._cache[k] for k in dict.fromkeys(keys) if k in self._cache}
      for k in found:
        self._cache.move_to_end(k)
    missing = [k for k in dict.fromkeys(keys) if k not in found]
    if missing:
      # A few windows: calls padded to a power of two, not to the full rows a dump's are.
      shard = encode_shard(self.tokenizer, [_part(passages[r], cut) for r, cut in missing],
                           self.config, self.mesh, self._encode, pad_last=False)
      bounds = np.searchsorted(shard["token_passage"], np.arange(len(missing) + 1))
      for i, (r, cut) in enumerate(missing):
        spans = shard["char_spans"][bounds[i]:bounds[i + 1]]
        found[r, cut] = (shard["vectors"][bounds[i]:bounds[i + 1]],
                         spans if cut is None else spans + cut[0])
      with self._lock:
        self.encoded_passages += len(missing)
        self.encoded_tokens += len(shard["vectors"])
        for k in missing:
          self._keep(k, found[k])
    return [found[k] for k in keys]

  def windows(self, texts: Sequence[str], spans: np.ndarray) -> list:
    """Per text, the (first, end) characters `read` takes of it around its best span `spans`
    [N, 2] (characters): `window_of` with this reader's window, None for the whole text."""
    if self.window is None:
      return [None] * len(texts)
    return [window_of(self.tokenizer, text, int(a), int(b), self.window)
            for text, (a, b) in zip(texts, spans)]

  def compile(self) -> int:
    """Compiles the phrase encoder for every call a re-reading makes (each power-of-two rows up
    to a call's, each width), in threads: a search then compiles nothing. Returns the shapes."""
    rows, multiple = phrase_calls(self.config.batch_size, self.mesh, self.config.width_multiple)
    counts = sorted({padded_rows(n, rows, self.mesh) for n in range(1, rows + 1)})
    widths = call_widths(multiple, self.config.max_seq_length)
    return sum(compile_ahead(self._encode, count, widths, self.mesh) for count in counts)

  def clear(self) -> None:
    """Empties the cache and the last questions' vectors (a timing of cold reads starts from
    it)."""
    with self._lock:
      self._cache.clear()
      self._cached = 0
      self._asked = None

  def _keep(self, row, entry: tuple[np.ndarray, np.ndarray]) -> None:
    """Caches a passage's vectors, the least recently read ones dropped past `cache_tokens`."""
    if row in self._cache:
      return
    self._cache[row] = entry
    self._cached += len(entry[0])
    while self._cached > self.cache_tokens and self._cache:
      self._cached -= len(self._cache.popitem(last=False)[1][0])


def _part(passage: Passage, cut: tuple[int, int] | None) -> Passage:
  """The passage, or the part of its text between characters `cut` (its title and id kept)."""
  return passage if cut is None else dataclasses.replace(passage,
                                                         text=passage.text[cut[0]:cut[1]])


def window_of(tokenizer: Tokenizer, text: str, first: int, end: int, tokens: int
              ) -> tuple[int, int] | None:
  """(first, end) characters of at most `tokens` word pieces of `text` (the span's own, when it
  is longer) centred on the span of characters [first, end) and holding it, cut only where a
  word ends (so that the part tokenizes as those word pieces do in the whole text: no word
  piece split); None when the text has at most `tokens` word pieces."""
  offsets = tokenizer.tokenize([text])[0][1]
  n = len(offsets)
  if n <= tokens:
    return None
  a = int(np.searchsorted(offsets[:, 1], first, "right"))  # the span's first word piece
  b = max(int(np.searchsorted(offsets[:, 0], end, "left")), a + 1)  # and the one after it
  lo = min(max((a + b - tokens) // 2, 0), n - tokens)
  lo, hi = min(lo, a), max(lo + tokens, b)
  joined = offsets[1:, 0] <= offsets[:-1, 1]  # word piece i + 1 follows i with no space
  while lo < min(a, n - 1) and lo > 0 and joined[lo - 1]:
    lo += 1
  while hi > b and hi < n and joined[hi - 1]:
    hi -= 1
  return int(offsets[lo, 0]), int(offsets[hi - 1, 1])


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


def wants_wider(passage_rows: np.ndarray, count: int, scores: np.ndarray,
                margin: float | None = None) -> bool:
  """Whether a wider ranking could give `top_passages` more passages to read: the ranked spans
  (passage rows, scores best first) hold fewer than `count` distinct passages and, with a
  `margin`, every one of them scores within it of the best (a span beyond it ends the read)."""
  if not len(scores) or len(np.unique(passage_rows)) >= count:
    return False
  return margin is None or bool(scores[-1] > scores[0] - margin)


def read_spans(rereader: Rereader, passages, q_start: np.ndarray, q_end: np.ndarray,
               picks: Sequence[np.ndarray], max_answer_length: int, first: int,
               cuts: Sequence[list] | None = None
               ) -> tuple[ReadTokens, list[tuple[np.ndarray, ...]]]:
  """The re-read passages `picks` (rows per question) of questions [Q, D]: their tokens
  (`ReadTokens`, numbered from `first`) and per question (starts, ends, exact scores) of every
  distinct best span of their tokens (`hybrid.lexical_spans`), in those token ids. `cuts`: per
  question, the part of each pick's text read (`Rereader.windows`; None: the whole text)."""
  cuts = cuts or [[None] * len(pick) for pick in picks]
  parts = [list(zip(map(int, pick), cut)) for pick, cut in zip(picks, cuts)]
  keys = list(dict.fromkeys(key for part in parts for key in part))
  if not keys:  # (an index without tokens ranks no span)
    empty = np.zeros(0, np.int64)
    return (ReadTokens(first, empty, np.zeros((0, 2), np.int32)),
            [(empty, empty, np.zeros(0, np.float32)) for _ in picks])
  read = rereader.read(keys, passages)
  sizes = np.array([len(vectors) for vectors, _ in read], np.int64)
  local = {key: i for i, key in enumerate(keys)}
  vectors = np.concatenate([v for v, _ in read])
  spans = np.concatenate([s for _, s in read])
  token_passage = np.repeat(np.arange(len(keys)), sizes)
  rescorer = Rescorer(vectors, token_passage, len(keys))
  found = hybrid.lexical_spans(rescorer, q_start, q_end,
                               [np.array([local[key] for key in part], np.int64)
                                for part in parts], max_answer_length)
  out = []
  for starts, ends, scores in found:
    _, at = np.unique(starts * max(len(token_passage), 1) + ends, return_index=True)
    at = at[np.argsort(-scores[at], kind="stable")]
    out.append((starts[at] + first, ends[at] + first, scores[at]))
  rows = np.array([row for row, _ in keys], np.int64)
  return ReadTokens(first, rows[token_passage], spans), out


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
