"""Phrase search over a dump + faiss index, and retrieval of sentences, passages, documents.

An exact (Flat) index is searched on the accelerator when there is one (`DeviceFlat`,
`index.search_device`); the approximate ones (IVF, PQ) by faiss on the host.

For a question with vectors (q_start, q_end): the index returns the top start tokens for q_start
and the top end tokens for q_end; every start hit i is paired with its best end j in
[i, i + max_answer_length) within the same passage, and every end hit j with its best start,
both scored exactly from the stored token vectors: s = q_start . h_i + q_end . h_j. Phrases are
deduplicated and sorted. A sentence, passage or document scores as its best phrase; more phrases
are fetched until k distinct units are found or `max_fetch` phrases (default 20 k; the reference
retrieves ~2k phrases for k units) have been asked for; the index itself is searched at most
twice per question (the first round, then once at `max_fetch` for the questions still short), and
`DensePhrases.search_many` serves several searches of the same questions with one. The hits of an
index search (`Hits`) keep what rescoring them found: the rounds and searches they serve rescore
each hit once.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import re
import threading
from typing import Sequence

import faiss
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.data.tokenization import Tokenizer
from dpjax.errors import DumpError
from dpjax.index.device_search import DeviceFlat, use_device_search
from dpjax.index.dump_reader import Dump
from dpjax.index.evaluate import retrieve_texts
from dpjax.index import hybrid
from dpjax.index.faiss_index import check_index, index_folder
from dpjax.index.manifest import INDEX_MANIFEST, check_index_of_dump, encoder_fingerprint
from dpjax.index.sparse import BUILD_HINT, SparseIndex
from dpjax.io import read_json
from dpjax.model_files import DEFAULT_MODEL
from dpjax.models.encoders import bound_questions, compile_questions, question_vectors
from dpjax.parallel import make_mesh, round_to_devices

log = logging.getLogger(__name__)

UNITS = ("phrase", "sentence", "passage", "document")
# float16 rows converted a call by the rescoring (`_score_converted`): 1.5 + 3 MiB at D = 384.
# The eval's rescoring on a Zen 4 core ran fastest at 1,024-2,048, 3% slower at 4,096, 13% at 8,192.
_CONVERT_ROWS = 2048
_RESCORE_ELEMENTS = 1 << 22  # bounds the (question, hit, partner) arrays of one rescoring
_LEXICAL_ELEMENTS = 1 << 25  # bounds the [questions, passages] BM25 scores of a hybrid search
# The threads that score a rescoring's tokens: at most this many, each given this many rows at
# least, so that a few questions' rescoring stays in one thread.
_RESCORE_THREADS = 16
_RESCORE_ROWS_PER_THREAD = 2048
_BLAS = None  # threadpoolctl's controller (`_blas_controller`), False without threadpoolctl
_BLAS_LOCK = threading.Lock()  # guards the two below (`_one_blas_thread`)
_BLAS_USERS = 0  # searches holding BLAS at one thread
_BLAS_LIMIT = None  # their limit, restored by the last
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
  start_token: int
  end_token: int
  passage: int  # row in the dump's passage table
  start_char: int
  end_char: int
  text: str
  # Lower-scoring spans overlapping this one, merged into it (`index.merge_spans`), best first.
  merged: list = dataclasses.field(default_factory=list)


def half_to_float32(half: np.ndarray) -> np.ndarray:
  """`half` [n, D] (float16) as a float32 array, exactly (subnormals, signed zeros and infinities
  bit for bit, NaNs stay NaNs): one jitted XLA convert on the host's CPU, vectorised (F16C /
  AVX-512): ~0.1-0.3 ns an element on a Zen 4 core where faiss's float16 decoder takes ~1.1 and
  numpy's `astype` ~1.6. Compiled once per shape; the result is read-only."""
  with jax.default_device(_host_cpu()):
    return np.asarray(_half_to_float32(half))


_half_to_float32 = jax.jit(lambda half: half.astype(jnp.float32))
_host_cpu = functools.cache(lambda: jax.devices("cpu")[0])


def sentence_bounds(text: str) -> list[int]:
  """Character offsets [0, ends..., len(text)] of the sentences of `text` (`_SENTENCE_END`): a
  sentence ends at . ! ? followed by whitespace, then not by a lower-case letter, nor after an
  abbreviation ("Dr.", "e.g.", "U.S.") or an initial ("J."); the whitespace goes with it."""
  ends = [m.end() for m in _SENTENCE_END.finditer(text)
          if not text[m.end()].islower()
          and not (text[m.start() - 1] == "." and _ABBREVIATION.search(text, 0, m.start()))]
  return [0] + ends + [len(text)]


def _scoring_threads(rows: int) -> int:
  """How many threads score `rows` distinct tokens (`PhraseIndex._token_scores`): as many as
  faiss may use (OpenMP's count: the cores, or OMP_NUM_THREADS), at most _RESCORE_THREADS and one
  per _RESCORE_ROWS_PER_THREAD rows; one without threadpoolctl (BLAS then keeps its threads)."""
  if _blas_controller() is None:
    return 1
  return max(1, min(faiss.omp_get_max_threads(), _RESCORE_THREADS,
                    rows // _RESCORE_ROWS_PER_THREAD))


def _blas_controller():
  """threadpoolctl's controller of the loaded BLAS libraries (numpy's, faiss's), made once;
  None where threadpoolctl is not installed."""
  global _BLAS
  if _BLAS is None:
    try:
      import threadpoolctl
    except ImportError:
      _BLAS = False
    else:
      _BLAS = threadpoolctl.ThreadpoolController()
  return _BLAS or None


@contextlib.contextmanager
def _one_blas_thread():
  """A context in which BLAS runs in the calling thread only: process-wide while any search is
  in one (counted, so that searches in several threads restore BLAS's own count once, when the
  last leaves)."""
  global _BLAS_USERS, _BLAS_LIMIT
  controller = _blas_controller()
  if controller is None:
    yield
    return
  with _BLAS_LOCK:
    if not _BLAS_USERS:
      _BLAS_LIMIT = controller.limit(limits=1, user_api="blas")
    _BLAS_USERS += 1
  try:
    yield
  finally:
    with _BLAS_LOCK:
      _BLAS_USERS -= 1
      if not _BLAS_USERS:
        _BLAS_LIMIT.restore_original_limits()
        _BLAS_LIMIT = None


def _balanced_groups(bounds: np.ndarray, count: int) -> list[tuple[int, int]]:
  """At most `count` contiguous (first, last) question ranges of about equal rows each
  (question q's rows are bounds[q]:bounds[q + 1])."""
  cuts = np.searchsorted(bounds, np.linspace(0, bounds[-1], max(count, 1) + 1)[1:-1])
  edges = np.unique(np.concatenate([[0], np.clip(cuts, 0, len(bounds) - 1), [len(bounds) - 1]]))
  return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _score_questions(source: np.ndarray, token: np.ndarray, queries: np.ndarray,
                     bounds: np.ndarray, scores: np.ndarray, first: int, last: int) -> None:
  """`scores[bounds[q]:bounds[q + 1]]` of questions first..last-1 under `queries[q]` [D, 2]:
  each question's distinct tokens' vectors (float32, from an exact index's own storage when it
  holds every token) gathered into a buffer reused across its questions, then one [U_q, D] x
  [D, 2] product. The rows stay in cache for their product: no [U, D] copy of every question's
  vectors goes through memory. Other sources (the dump's float16): `_score_converted`."""
  if source.dtype != np.float32:
    _score_converted(source, token, queries, bounds, scores, first, last)
    return
  sizes = np.diff(bounds[first:last + 1])
  # At least two rows a product: BLAS rounds a one-row product (a gemv) differently, and a
  # token's score must not depend on which other tokens its question's product holds.
  gathered = np.empty((max(int(sizes.max(initial=0)), 2), source.shape[1]), np.float32)
  for q in range(first, last):
    lo, hi = bounds[q], bounds[q + 1]
    np.take(source, token[lo:hi], axis=0, out=gathered[:hi - lo], mode="clip")
    scores[lo:hi] = (gathered[:max(hi - lo, 2)] @ queries[q])[:hi - lo]


def _score_converted(source: np.ndarray, token: np.ndarray, queries: np.ndarray,
                     bounds: np.ndarray, scores: np.ndarray, first: int, last: int) -> None:
  """`_score_questions` from rows to convert (the dump's float16): the rows of consecutive
  questions, up to `_CONVERT_ROWS`, are gathered into one buffer and converted by one call of
  one shape (`half_to_float32`); a question with more rows is converted alone, in such pieces.
  Each question's product is the same [max(U_q, 2), D] x [D, 2] one, bit for bit."""
  half = np.zeros((_CONVERT_ROWS, source.shape[1]), source.dtype)
  q = first
  while q < last:
    lo = bounds[q]
    # The questions whose rows end within the chunk, one row spare (two rows a product).
    end = min(max(int(np.searchsorted(bounds, lo + _CONVERT_ROWS - 1, "right")) - 1, q + 1),
              last)
    hi = bounds[end]
    if hi - lo < _CONVERT_ROWS:
      np.take(source, token[lo:hi], axis=0, out=half[:hi - lo], mode="clip")
      rows = half_to_float32(half)
    else:  # one question of more rows than a chunk
      rows = np.empty((hi - lo, source.shape[1]), np.float32)
      for at in range(0, hi - lo, _CONVERT_ROWS):
        n = min(_CONVERT_ROWS, hi - lo - at)
        np.take(source, token[lo + at:lo + at + n], axis=0, out=half[:n], mode="clip")
        rows[at:at + n] = half_to_float32(half)[:n]
    for p in range(q, end):
      a, b = bounds[p] - lo, bounds[p + 1] - lo
      scores[lo + a:lo + b] = (rows[a:max(b, a + 2)] @ queries[p])[:b - a]
    q = end


def check_request(k: int, unit: str) -> int:
  """Refuses a unit not in UNITS and a k below 1 (faiss would fail on it without a message);
  returns k as a Python int (faiss refuses numpy integers)."""
  if unit not in UNITS:
    raise ValueError(f"unknown retrieval unit {unit!r}; one of {UNITS}")
  return _count(k, "k (the number of results)")


def _count(value, name: str) -> int:
  """`value` as a Python int, or a ValueError naming it unless an integer >= 1."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be >= 1 (an integer), got {value!r}")
  return int(value)


def _tokenless(attention_mask: np.ndarray) -> np.ndarray:
  """The rows of tokenised questions that hold [CLS] [SEP] only."""
  return np.flatnonzero(attention_mask.sum(1) <= 2)


class PhraseIndex:
  """A complete dump with one of its faiss indexes."""

  def __init__(self, dump: Dump | str | os.PathLike, index_name: str = "Flat",
               nprobe: int | None = None, search_device: str = "auto", *, verify: bool = False):
    """The dump's index `index_name`; the sizes of its and the dump's files are checked against
    those recorded when written, and with `verify` their contents (`index.verify`)."""
    self.dump = dump if isinstance(dump, Dump) else Dump.load(dump, verify=verify)
    if not (self.dump.directory / "indexes" / index_name).is_dir():
      index_name = index_folder(index_name)  # a factory string ("IVFauto,SQ4") names its folder
    directory = self.dump.directory / "indexes" / index_name
    if not (directory / INDEX_MANIFEST).is_file():
      available = sorted(p.name for p in (self.dump.directory / "indexes").glob("*")
                         if (p / INDEX_MANIFEST).is_file())
      raise DumpError(f"{directory}: no index named {index_name!r} (available: {available}); "
                      "build it with `run.py index`")
    self.manifest = read_json(directory / INDEX_MANIFEST, DumpError,
                              "build the index again with `run.py index`")
    check_index(directory, self.manifest, contents=verify)
    check_index_of_dump(directory, self.manifest, self.dump.directory, self.dump.manifest)
    if nprobe is not None and nprobe < 1:
      raise ValueError(f"nprobe must be >= 1, got {nprobe}")
    threshold = self.manifest.get("filter_threshold")
    self.kept_mask = (None if threshold is None else
                      self.dump.filter_logits.astype(np.float32).max(1) >= threshold)
    self.index = self._device_index(search_device)
    if self.index is None:
      try:
        self.index = faiss.read_index(str(directory / "index.faiss"))
      except RuntimeError as e:  # a damaged or truncated file (faiss's C++ error)
        raise DumpError(f"{directory / 'index.faiss'}: unreadable ({str(e).splitlines()[0]}); "
                        "build the index again with `run.py index`") from None
      if hasattr(self.index, "nprobe") or "IVF" in self.manifest["resolved_spec"]:
        faiss.ParameterSpace().set_index_parameter(self.index, "nprobe",
                                                   nprobe or self.manifest["nprobe"])
    self._setup()

  def _device_index(self, search_device: str) -> DeviceFlat | None:
    """The exact index searched on the accelerator (`use_device_search`): its vectors are the
    dump's, those the filter keeps; None for an approximate index or the host's faiss."""
    tokens = self.manifest["num_tokens"]
    if self.manifest["resolved_spec"] != "Flat" or not tokens or not use_device_search(
        search_device, 2 * tokens * self.dump.vectors.shape[1]):
      return None
    if self.kept_mask is None:
      return DeviceFlat(self.dump.vectors)
    kept = np.flatnonzero(self.kept_mask)
    if len(kept) != tokens:  # the filter logits changed after the index was built: its own set
      return None
    return DeviceFlat(self.dump.vectors[kept], kept)

  @classmethod
  def over_passages(cls, dump: Dump, passages: Sequence[int] | None = None, *,
                    search_device: str = "auto") -> "PhraseIndex":
    """An exact (Flat, in memory) index over the tokens of some passages of a dump (default all).

    Phrase vectors do not depend on the other passages of a corpus, so the index of any
    subcorpus is a subset of the full dump's tokens: validation subcorpora need no new dump.
    """
    rows = np.arange(len(dump.passages)) if passages is None else np.unique(passages)
    return cls.over_tokens(dump, np.flatnonzero(np.isin(dump.token_passage, rows)),
                           num_passages=len(rows), search_device=search_device)

  @classmethod
  def over_tokens(cls, dump: Dump, tokens: np.ndarray, *, num_passages: int | None = None,
                  search_device: str = "auto") -> "PhraseIndex":
    """An exact (Flat, in memory) index over some tokens of a dump (e.g. those a filter keeps);
    phrases start and end only at these tokens. `search_device` as `index.search_device`."""
    self = cls.__new__(cls)
    self.dump = dump
    tokens = np.asarray(tokens, np.int64)
    if len(tokens) and use_device_search(search_device, 2 * len(tokens) * dump.vectors.shape[1]):
      self.index = DeviceFlat(dump.vectors[tokens], tokens)
    else:
      self.index = faiss.index_factory(dump.vectors.shape[1], "IDMap,Flat",
                                       faiss.METRIC_INNER_PRODUCT)
      for lo in range(0, len(tokens), 1 << 18):
        part = tokens[lo:lo + (1 << 18)]
        self.index.add_with_ids(dump.vectors[part].astype(np.float32), part)
    if num_passages is None:
      num_passages = len(np.unique(dump.token_passage[tokens]))
    self.kept_mask = np.zeros(len(dump.vectors), bool)
    self.kept_mask[tokens] = True
    self.manifest = {"spec": "Flat", "resolved_spec": "Flat", "labels": "token_id",
                     "num_tokens": int(len(tokens)), "num_passages": int(num_passages),
                     "fingerprint": dump.manifest["fingerprint"], "build_seconds": 0.0,
                     "index_bytes": int(len(tokens)) * (4 * dump.vectors.shape[1] + 8)}
    self._setup()
    return self

  def _setup(self) -> None:
    self.num_vectors = int(self.manifest["num_tokens"])
    self.sparse, self.sparse_weight, self.sparse_passages = None, 0.0, 20
    self.merge_spans = True
    token_passage = self.dump.token_passage
    num_passages = len(self.dump.passages)
    self.passage_start = np.searchsorted(token_passage, np.arange(num_passages), "left")
    self.passage_end = np.searchsorted(token_passage, np.arange(num_passages), "right")
    self._sentences: dict[int, np.ndarray] = {}
    vectors = self.dump.vectors
    if self.num_vectors and vectors.dtype != np.float32 and self._exact_vectors() is None:
      # the rescoring converts the dump's rows (`_score_converted`): compiled now, not searching
      half_to_float32(np.zeros((_CONVERT_ROWS, vectors.shape[1]), vectors.dtype))

  @property
  def fingerprint(self) -> str:
    return self.dump.manifest["fingerprint"]

  def _hits(self, q_start: np.ndarray, q_end: np.ndarray, k: int) -> "Hits":
    """Top-k start and end token ids, [Q, k] each (-1 where fewer than k were found), from one
    faiss search of [q_start; q_end] (one pass over the vectors serves both)."""
    queries = np.ascontiguousarray(np.concatenate([q_start, q_end]), np.float32)
    if k < 1:  # an index without tokens (faiss refuses k = 0)
      labels = np.full((len(queries), 0), -1, np.int64)
    else:
      _, labels = self.index.search(queries, k)
    return Hits(labels[:len(q_start)], labels[len(q_start):], q_start, q_end, self)

  def search_phrases(self, q_start: np.ndarray, q_end: np.ndarray, k: int = 10, *,
                     top_tokens: int | None = None, max_answer_length: int = 10,
                     hits: tuple[np.ndarray, np.ndarray] | None = None) -> list[list[Phrase]]:
    """Top-k phrases for each question vector pair (q_start, q_end: [Q, D]).

    `hits`: the (start, end) token ids of an earlier, wider search of the same questions
    ([Q, >= top_tokens] each); their first `top_tokens` columns are this search's hits.
    """
    k = _count(k, "k (the number of phrases)")
    top_tokens = min(max(top_tokens or k, k), self.num_vectors)
    spans = self._spans(q_start, q_end, top_tokens, max_answer_length, hits)
    return [[self.phrase(int(s), int(e), float(x)) for s, e, x in zip(*(a[:k] for a in found))]
            for found in spans]

  def _spans(self, q_start, q_end, top_tokens: int, max_answer_length: int, hits=None,
             rows: np.ndarray | None = None):
    """Per question, (starts, ends, scores) of its distinct spans, best first, from its top
    `top_tokens` start and end hits: searched, or the first columns of `hits` (of these
    questions, or with `rows` of the questions at those rows of `hits`)."""
    _count(max_answer_length, "max_answer_length (in tokens)")
    if hits is None:
      # Rescoring holds a few [queries, 2 top_tokens, max_answer_length] arrays: bound them.
      chunk = max(1, _RESCORE_ELEMENTS // max(2 * top_tokens * max_answer_length, 1))
      results = []
      for lo in range(0, len(q_start), chunk):
        part = slice(lo, lo + chunk)
        starts, ends = self._hits(q_start[part], q_end[part], top_tokens)
        results += _ranked(*self._rescore(q_start[part], q_end[part], starts, ends,
                                          max_answer_length), len(self.dump.vectors))
      return results
    if rows is None:
      rows = np.arange(len(q_start))
    if not self._asked(hits, q_start, q_end, rows):
      hits, rows = Hits(hits[0][rows], hits[1][rows], q_start, q_end, self), np.arange(len(rows))
    return hits.rescored(max_answer_length).spans(rows, top_tokens)

  def _asked(self, hits, q_start, q_end, rows: np.ndarray) -> bool:
    """Whether `hits` are this index's search of these questions (at its `rows`): `Hits` whose
    rescored spans these questions may share."""
    return (isinstance(hits, Hits) and hits.index is self
            and np.array_equal(hits.queries[0][rows], q_start)
            and np.array_equal(hits.queries[1][rows], q_end))

  def _token_scores(self, tokens: np.ndarray, q_start: np.ndarray, q_end: np.ndarray):
    """(start scores, end scores) of token ids [Q, ...] under their question's vectors.

    Hits of one question crowd into few passages, so each distinct (question, token) is scored
    once, a question at a time (`_score_questions`). The questions are split into contiguous
    groups scored in as many threads as faiss may use (`_scoring_threads`), with BLAS and faiss
    (OpenMP) held at one thread: their idle threads would spin on the cores the others need. A
    question's scores come from the same product, bit for bit, whichever thread computes it."""
    num_q, n = len(q_start), len(self.dump.vectors)
    keys = np.arange(num_q)[:, None] * n + tokens.reshape(num_q, -1)
    unique, inverse = np.unique(keys, return_inverse=True)
    question, token = np.divmod(unique, n)
    exact = self._exact_vectors()
    source = exact if exact is not None else self.dump.vectors
    queries = np.stack([q_start, q_end], -1).astype(np.float32)  # [Q, D, 2]
    scores = np.empty((len(unique), 2), np.float32)
    bounds = np.searchsorted(question, np.arange(num_q + 1))
    groups = _balanced_groups(bounds, _scoring_threads(len(unique)))
    score = functools.partial(_score_questions, source, token, queries, bounds, scores)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # this thread's count; each worker sets its own
    try:
      with _one_blas_thread():
        if len(groups) == 1:
          score(*groups[0])
        else:
          with concurrent.futures.ThreadPoolExecutor(
              len(groups), initializer=faiss.omp_set_num_threads, initargs=(1,)) as pool:
            for done in [pool.submit(score, *group) for group in groups]:
              done.result()
    finally:
      faiss.omp_set_num_threads(threads)
    inverse = inverse.reshape(tokens.shape)
    return scores[inverse, 0], scores[inverse, 1]

  def _exact_vectors(self) -> np.ndarray | None:
    """The float32 [N, D] vectors of every dump token, row = token id, when the faiss index
    stores them so (an unfiltered Flat): a view of its storage, no copy. Else None."""
    if not hasattr(self, "_exact"):
      self._exact = None
      flat = faiss.downcast_index(self.index.index) if isinstance(
          self.index, faiss.IndexIDMap) else None
      n, dim = self.dump.vectors.shape
      if isinstance(flat, faiss.IndexFlat) and flat.ntotal == n and np.array_equal(
          faiss.vector_to_array(self.index.id_map), np.arange(n)):
        self._exact = faiss.rev_swig_ptr(flat.get_xb(), n * dim).reshape(n, dim)
    return self._exact

  def _rescore(self, q_start, q_end, starts, ends, max_answer_length: int):
    """Every start hit paired with its best end within `max_answer_length` tokens of its passage,
    every end hit with its best start: (scores, span starts, span ends) [Q, Ks + Ke] of the
    hits (starts, then ends), -inf where a hit is -1 or has no partner. A hit's best span
    depends on its question and itself only."""
    offsets = np.arange(max_answer_length)
    anchors = np.concatenate([starts, ends], 1)  # [Q, 2K]
    valid = anchors >= 0
    anchor = np.maximum(anchors, 0)
    forward = np.arange(anchors.shape[1]) < starts.shape[1]  # start anchors look forward
    partners = anchor[..., None] + np.where(forward[:, None], offsets, -offsets)  # [Q, 2K, L]
    passage = self.dump.token_passage[anchor]
    ok = ((partners >= self.passage_start[passage][..., None])
          & (partners < self.passage_end[passage][..., None]) & valid[..., None])
    partners = np.clip(partners, 0, len(self.dump.vectors) - 1)
    if self.kept_mask is not None:  # filtered tokens are neither starts nor ends
      ok &= self.kept_mask[partners]
    span_start = np.where(forward[:, None], anchor[..., None], partners)
    span_end = np.where(forward[:, None], partners, anchor[..., None])
    # Every anchor is its own partner at offset 0: the partners' scores hold the anchors' too.
    score_s, score_e = self._token_scores(partners, q_start, q_end)  # [Q, 2K, L] each
    total = np.where(forward[:, None], score_s[..., :1] + score_e, score_s + score_e[..., :1])
    total = np.where(ok, total, -np.inf)
    best = total.argmax(-1)[..., None]  # an anchor's best partner (the nearest on ties)
    scores = np.take_along_axis(total, best, -1)[..., 0]
    all_start = np.take_along_axis(span_start, best, -1)[..., 0]
    all_end = np.take_along_axis(span_end, best, -1)[..., 0]
    return scores, all_start, all_end

  def phrase(self, start: int, end: int, score: float) -> Phrase:
    passage = int(self.dump.token_passage[start])
    s, e = int(self.dump.char_spans[start, 0]), int(self.dump.char_spans[end, 1])
    return Phrase(score, start, end, passage, s, e, self.dump.passages[passage].text[s:e])

  def sentence_of(self, phrase: Phrase) -> tuple[int, int]:
    """(start, end) characters of the sentence holding the phrase's first character."""
    if phrase.passage not in self._sentences:
      text = self.dump.passages[phrase.passage].text
      self._sentences[phrase.passage] = np.array(sentence_bounds(text))
    bounds = self._sentences[phrase.passage]
    i = int(np.searchsorted(bounds, phrase.start_char, "right")) - 1
    return int(bounds[i]), int(bounds[i + 1])

  def unit_key(self, phrase: Phrase, unit: str):
    if unit == "phrase":
      return (phrase.start_token, phrase.end_token)
    if unit == "sentence":
      return (phrase.passage, self.sentence_of(phrase))
    if unit == "passage":
      return phrase.passage
    if unit == "document":
      return _document_key(self.dump.passages[phrase.passage])
    raise ValueError(f"unknown retrieval unit {unit!r}; one of {UNITS}")

  def _best_units(self, starts: np.ndarray, ends: np.ndarray, scores: np.ndarray, unit: str,
                  k: int) -> list[Phrase]:
    """The best phrase of each of the top-k units among ranked spans; phrases overlapping a
    better one are merged into it (`merge_spans`, phrase unit)."""
    if unit == "phrase" and self.merge_spans:
      leads, others = hybrid.overlap_groups(starts, ends, k)
      best = []
      for lead, merged in zip(leads, others):
        phrase = self.phrase(int(starts[lead]), int(ends[lead]), float(scores[lead]))
        phrase.merged = [self.phrase(int(starts[i]), int(ends[i]), float(scores[i]))
                         for i in merged]
        best.append(phrase)
      return best
    return [self.phrase(int(starts[i]), int(ends[i]), float(scores[i]))
            for i in self._first_of_units(starts, ends, unit)[:k]]

  def _lexical_rows(self) -> int | None:
    """Questions a hybrid search scores with BM25 at once (None: a dense search)."""
    if self.sparse is None or not self.sparse_weight:
      return None
    return max(1, _LEXICAL_ELEMENTS // max(self.sparse.num_passages, 1))

  def _lexical(self, q_start: np.ndarray, texts: Sequence[str] | None):
    """(BM25 scores [Q, P], top BM25 passages per question) for hybrid search, or None for a
    dense search."""
    if self._lexical_rows() is None:
      return None
    if texts is None or isinstance(texts, str) or len(texts) != len(q_start):
      raise ValueError("hybrid search (index.sparse) needs the text of every question searched")
    bm25 = self.sparse.scores(list(texts))
    return (bm25, hybrid.top_passages(bm25, self.sparse_passages))

  def use_sparse(self, sparse: SparseIndex | None, weight: float | None = None, *,
                 passages: int = 20) -> None:
    """Hybrid search with a BM25 index of this dump (None: dense search only): a phrase scores
    its dense score + `weight` (default: the one recorded in the BM25 index) x its passage's
    BM25 score; the spans of the top `passages` BM25 passages join the candidates."""
    if sparse is not None:
      if sparse.manifest.get("dump_id") != self.dump.manifest.get("dump_id", ""):
        raise DumpError(f"{sparse.directory} was built from another dump than "
                        f"{self.dump.directory}: {BUILD_HINT}")
      weight = sparse.weight if weight is None else weight
      if weight is None:
        raise DumpError(f"{sparse.directory} records no hybrid weight: choose one with `run.py "
                        "index --set index.sparse=True` (it tunes it) or set index.sparse_weight")
      _count(passages, "index.sparse_passages")
    self.sparse, self.sparse_weight, self.sparse_passages = sparse, float(weight or 0), passages

  def _first_of_units(self, starts: np.ndarray, ends: np.ndarray, unit: str) -> np.ndarray:
    """Positions of the first (best) phrase of each distinct unit among ranked phrases."""
    if unit == "phrase":  # the spans are distinct already
      return np.arange(len(starts))
    if unit == "sentence":
      codes = {}
      keys = [codes.setdefault(self.unit_key(self.phrase(int(s), int(e), 0.0), unit), len(codes))
              for s, e in zip(starts, ends)]
    elif unit == "passage":
      keys = self.dump.token_passage[starts]
    else:
      keys = self._documents()[self.dump.token_passage[starts]]
    return np.sort(np.unique(np.asarray(keys, np.int64), return_index=True)[1])

  def _documents(self) -> np.ndarray:
    """A document number of every passage row (`_document_key`)."""
    if not hasattr(self, "_document_of"):
      names: dict = {}
      self._document_of = np.array([names.setdefault(_document_key(p), len(names))
                                    for p in self.dump.passages], np.int64)
    return self._document_of

  def fetch_bounds(self, k: int, *, top_tokens: int | None = None,
                   max_fetch: int | None = None) -> tuple[int, int]:
    """(first, most) phrases a unit search asks for: it starts at `first` and grows to at most
    `most` (20 k by default) while a question has fewer than k distinct units."""
    first = max(top_tokens or 2 * k, k)
    # A question whose best phrases crowd into few units would otherwise grow the fetch (and
    # the exact rescoring) without bound; it then gets fewer than k units. Every token a hit
    # (a search of as many tokens as the index has) gives up to two phrases per token: a cap at
    # the token count would cut a small index's phrases, and its last units, in half.
    return first, min(max(max_fetch or 20 * k, first), 2 * self.num_vectors)

  def hits(self, q_start: np.ndarray, q_end: np.ndarray, n: int) -> "Hits":
    """Top-n start and end token ids ([Q, n] each) of one index search, for `search(hits=)`:
    the searches given them rescore each hit once between them."""
    return self._hits(q_start, q_end, min(n, self.num_vectors))

  def search(self, q_start: np.ndarray, q_end: np.ndarray, k: int = 10, unit: str = "phrase",
             *, top_tokens: int | None = None, max_answer_length: int = 10,
             max_fetch: int | None = None, hits: tuple[np.ndarray, np.ndarray] | None = None,
             texts: Sequence[str] | None = None) -> list[list[tuple[Phrase, object]]]:
    """Top-k units (each with its best phrase) per question.

    `hits`: `self.hits(q_start, q_end, n)` of these questions, shared by several searches (e.g.
    phrases and passages): rounds that need at most n tokens use its first columns instead of
    searching the index again (the same hits, up to ties of an approximate index's scores).
    `texts`: the questions' texts, which hybrid search (`use_sparse`) needs for BM25.
    """
    k = check_request(k, unit)
    step = self._lexical_rows()
    if step and len(q_start) > step:  # the BM25 scores of `step` questions at a time
      return [found for lo in range(0, len(q_start), step) for found in self.search(
          q_start[lo:lo + step], q_end[lo:lo + step], k, unit, top_tokens=top_tokens,
          max_answer_length=max_answer_length, max_fetch=max_fetch,
          texts=None if texts is None else texts[lo:lo + step],
          hits=None if hits is None else (hits[0][lo:lo + step], hits[1][lo:lo + step]))]
    lexical = self._lexical(q_start, texts)
    if lexical is not None:
      lexical += (hybrid.lexical_spans(self, q_start, q_end, lexical[1], max_answer_length),)
    first, max_fetch = self.fetch_bounds(k, top_tokens=top_tokens, max_fetch=max_fetch)
    fetch = first
    units: list = [None] * len(q_start)
    pending = np.arange(len(q_start))
    if hits is not None and not self._asked(hits, q_start, q_end, pending):
      hits = Hits(hits[0], hits[1], q_start, q_end, self)  # its rounds share their rescoring
    wide, wide_row = (None, None) if hits is None else (hits, np.arange(len(q_start)))
    while len(pending):
      needed = min(fetch, self.num_vectors)
      if (wide is None and fetch > first) or (wide is not None and wide[0].shape[1] < needed):
        # One index search at max_fetch serves every later round: the top-f hits of a search
        # are the first f of a wider one, so only the rescoring grows round by round.
        wide = self.hits(q_start[pending], q_end[pending], max_fetch)
        wide_row = np.full(len(q_start), -1)
        wide_row[pending] = np.arange(len(pending))
      spans = self._spans(q_start[pending], q_end[pending], needed, max_answer_length, wide,
                          None if wide is None else wide_row[pending])
      short = []
      for q, (starts, ends, scores) in zip(pending, spans):  # the best `fetch` phrases
        ranked = (starts[:fetch], ends[:fetch], scores[:fetch])
        if lexical is not None:
          ranked = hybrid.fuse(ranked, lexical[2][q], lexical[0][q], self.dump.token_passage,
                               self.sparse_weight)
        units[q] = [(p, self.unit_key(p, unit)) for p in self._best_units(*ranked, unit, k)]
        if len(units[q]) < k and fetch < max_fetch:
          short.append(q)
      pending = np.array(short, dtype=np.int64)
      fetch = min(fetch * 4, max_fetch)
    return units

  def result(self, phrase: Phrase, unit: str = "phrase") -> dict:
    """A JSON-friendly description of a retrieved phrase (and its unit)."""
    passage = self.dump.passages[phrase.passage]
    out = {"answer": phrase.text, "score": phrase.score, "start_char": phrase.start_char,
           "end_char": phrase.end_char, "passage_id": passage.id,
           "passage_row": phrase.passage, "title": passage.title,
           "passage": passage.text}
    if unit == "sentence":
      s, e = self.sentence_of(phrase)
      out["sentence"] = passage.text[s:e].strip()
    if phrase.merged:
      out["merged"] = [{"answer": m.text, "score": m.score, "start_char": m.start_char,
                        "end_char": m.end_char} for m in phrase.merged]
    return out


def _document_key(passage) -> str | tuple[str, str]:
  """A passage's document: its title (the passages of one title), or ("id", its id) for an
  untitled passage alone (a tuple: an id equal to another passage's title is another document)."""
  return passage.title if passage.title else ("id", passage.id)


class Hits(tuple):
  """(start token ids, end token ids) [Q, n] each of one index search (`PhraseIndex.hits`) of
  questions (q_start, q_end); it keeps what rescoring them found (`rescored`), so the rounds of
  a unit search and the searches sharing it (`retrieve`) rescore each hit once."""

  def __new__(cls, starts: np.ndarray, ends: np.ndarray, q_start: np.ndarray, q_end: np.ndarray,
              index: PhraseIndex):
    self = super().__new__(cls, (starts, ends))
    self.queries = (np.array(q_start, np.float32), np.array(q_end, np.float32))  # copies
    self.index = index
    self._rescored: dict[int, _Rescored] = {}  # by max_answer_length
    return self

  def rescored(self, max_answer_length: int) -> "_Rescored":
    if max_answer_length not in self._rescored:
      self._rescored[max_answer_length] = _Rescored(self, max_answer_length)
    return self._rescored[max_answer_length]


class _Rescored:
  """The best span of each start and end hit of a `Hits`, each hit rescored once, the first
  columns first, as searches ask for them. A hit's best span depends on its question and itself
  only (`PhraseIndex._rescore`), so the first f columns rescored in pieces are exactly those
  columns rescored at once."""

  def __init__(self, hits: Hits, max_answer_length: int):
    self.hits, self.max_answer_length = hits, max_answer_length
    num_q, width = hits[0].shape
    self.scores = np.full((num_q, 2, width), -np.inf, np.float32)  # of start hits, end hits
    self.partner = np.zeros((num_q, 2, width), np.int64)  # a hit's best span's other end
    self.done = np.zeros(num_q, np.int64)  # columns rescored, per question

  def spans(self, rows: np.ndarray, width: int) -> list[tuple[np.ndarray, ...]]:
    """Per row of `rows`, (starts, ends, scores) of its distinct spans from its first `width`
    start and end hits, best first."""
    width = min(width, self.hits[0].shape[1])
    self._rescore(rows, width)
    starts, ends = (h[rows, :width] for h in self.hits)
    partner = self.partner[rows, :, :width]
    return _ranked(self.scores[rows, :, :width].reshape(len(rows), -1),
                   np.concatenate([starts, partner[:, 1]], 1),
                   np.concatenate([partner[:, 0], ends], 1), len(self.hits.index.dump.vectors))

  def _rescore(self, rows: np.ndarray, width: int) -> None:
    todo = rows[self.done[rows] < width]
    for done in np.unique(self.done[todo]):
      group, new = todo[self.done[todo] == done], width - done
      # Rescoring holds a few [queries, 2 new, max_answer_length] arrays: bound them.
      chunk = max(1, _RESCORE_ELEMENTS // (2 * new * self.max_answer_length))
      for lo in range(0, len(group), chunk):
        part = group[lo:lo + chunk]
        scores, span_start, span_end = self.hits.index._rescore(
            self.hits.queries[0][part], self.hits.queries[1][part],
            self.hits[0][part, done:width], self.hits[1][part, done:width],
            self.max_answer_length)
        self.scores[part, :, done:width] = scores.reshape(len(part), 2, new)
        self.partner[part, 0, done:width] = span_end[:, :new]
        self.partner[part, 1, done:width] = span_start[:, new:]
      self.done[group] = width


def _ranked(scores: np.ndarray, span_start: np.ndarray, span_end: np.ndarray,
            num_tokens: int) -> list[tuple[np.ndarray, ...]]:
  """Per question (row of the [Q, H] arrays of its hits' best spans), (starts, ends, scores) of
  its distinct spans, best first (ties in hit order; a span several hits found, at its first
  place); spans scored -inf left out."""
  results = []
  for q in range(len(scores)):
    order = np.argsort(-scores[q], kind="stable")
    order = order[np.isfinite(scores[q, order])]
    spans = span_start[q, order].astype(np.int64) * num_tokens + span_end[q, order]
    order = order[np.sort(np.unique(spans, return_index=True)[1])]  # distinct, best first
    results.append((span_start[q, order], span_end[q, order], scores[q, order]))
  return results


def _dump_tokenizer(index: PhraseIndex) -> Tokenizer:
  """The tokenizer the index's dump was made with (`run.py dump` records it), else MiniLM's."""
  name = index.dump.manifest.get("model", {}).get("tokenizer")
  if name is None:  # a dump from before the tokenizer was recorded, or made from Python
    log.warning("%s does not say which tokenizer made it: questions are tokenized by %s's; "
                "pass DensePhrases(..., tokenizer=) if the model has another",
                index.dump.directory, DEFAULT_MODEL)
    return Tokenizer.from_pretrained()
  return Tokenizer.from_pretrained(name)


class DensePhrases:
  """Question answering over a phrase index: `DensePhrases(model, index).search(questions)`."""

  def __init__(self, model, index: PhraseIndex, tokenizer=None, *, max_query_length: int = 64,
               batch_size: int = 64, mesh=None, check_model: bool = True):
    if check_model and encoder_fingerprint(model) != index.fingerprint:
      raise DumpError(f"the model's phrase encoder is not the one that made {index.dump.directory}"
                      " (fingerprints differ): dump the corpus again with this model")
    self.model, self.index = model, index
    self.tokenizer = tokenizer or _dump_tokenizer(index)
    self.max_query_length = max_query_length
    self.mesh = mesh or make_mesh()
    self.batch_size = round_to_devices(batch_size, self.mesh)
    self._encode = bound_questions(model)

  def compile(self, max_questions: int | None = None) -> int:
    """Compiles the question encoder for every call `encode` makes with at most `max_questions`
    questions at once (`compile_questions`), in threads; returns the shapes."""
    return compile_questions(self._encode, self.batch_size, self.mesh, self.max_query_length,
                             max_questions)

  def empty_questions(self, questions: Sequence[str]) -> list[int]:
    """The questions that hold no token: empty, or only characters the tokenizer drops (control
    and format characters such as a zero-width space, U+FEFF, NUL)."""
    return _tokenless(self.tokenizer.encode(list(questions), self.max_query_length)[1]).tolist()

  def encode(self, questions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(questions, str):
      raise ValueError("questions must be a list of strings, not one string")
    ids, mask = self.tokenizer.encode(list(questions), self.max_query_length)
    empty = _tokenless(mask)
    if len(empty):
      raise ValueError(f"question {int(empty[0])} ({questions[empty[0]][:40]!r}) has no tokens: "
                       f"it is empty or only characters the tokenizer drops ({len(empty)} such)")
    return question_vectors(self._encode, ids, mask, batch_size=self.batch_size, mesh=self.mesh)

  def search(self, questions: str | Sequence[str], k: int = 10, unit: str = "phrase",
             **kwargs) -> list[list[dict]] | list[dict]:
    single = isinstance(questions, str)
    texts = [questions] if single else list(questions)
    q_start, q_end = self.encode(texts)
    found = self.index.search(q_start, q_end, k, unit, texts=texts, **kwargs)
    results = [[self.index.result(p, unit) for p, _ in units] for units in found]
    return results[0] if single else results

  def search_many(self, questions: Sequence[str], requests: Sequence[tuple[int, str]],
                  **kwargs) -> list[list[list[dict]]]:
    """Several searches of the same questions, e.g. `[(10, "phrase"), (20, "passage")]`: the
    questions are encoded once and the index is searched once, as wide as the widest needs;
    256 questions at a time, the next encoded while the last are searched (`retrieve_texts`)."""
    if not requests:
      raise ValueError("search_many needs at least one (k, unit) request")
    if isinstance(questions, str):  # (its letters would be the questions)
      raise ValueError("search_many takes a list of questions, not one string")
    # checked before the index search that the widest request sizes
    requests = [(check_request(k, unit), unit) for k, unit in requests]
    found = retrieve_texts(self.index, self.encode, list(questions), requests, shared_hits=True,
                           **kwargs)
    return [[[self.index.result(p, unit) for p, _ in units] for units in per_request]
            for (_, unit), per_request in zip(requests, found)]
