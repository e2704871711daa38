"""The token scoring of the exact rescoring (`Rescorer.rescore`): each distinct (question,
token) its hits reach scored once, from an exact index's float32 rows, the dump's float16 rows
converted a chunk at a time (`half_to_float32`) or a compact index's codes decoded so, the
questions split over threads with BLAS and faiss held at one thread each.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading

import faiss
import jax
import jax.numpy as jnp
import numpy as np

# float16 rows converted a call by the rescoring (`_score_converted`): 1.5 + 3 MiB at D = 384.
# The eval's rescoring on a Zen 4 core ran fastest at 1,024-2,048 rows a call, slower at more
# (results/speed_history.md has the eval with this convert).
CONVERT_ROWS = 2048
RESCORE_ELEMENTS = 1 << 22  # bounds the (question, hit, partner) arrays of one rescoring
# The threads that score a rescoring's tokens: at most this many, each given this many rows at
# least, so that a few questions' rescoring stays in one thread.
_RESCORE_THREADS = 16
_RESCORE_ROWS_PER_THREAD = 2048
_BLAS = None  # threadpoolctl's controller (`_blas_controller`), False without threadpoolctl
_BLAS_LOCK = threading.Lock()  # guards the two below (`_one_blas_thread`)
_BLAS_USERS = 0  # searches holding BLAS at one thread
_BLAS_LIMIT = None  # their limit, restored by the last


def half_to_float32(half: np.ndarray) -> np.ndarray:
  """`half` [n, D] (float16) as a float32 array, exactly (subnormals, signed zeros and infinities
  bit for bit, NaNs stay NaNs): one jitted XLA convert on the host's CPU, vectorised (F16C /
  AVX-512), faster per element on a Zen 4 core than faiss's float16 decoder or numpy's `astype`
  (the eval with it: results/speed_history.md). Compiled once per shape; the result is
  read-only."""
  with jax.default_device(_host_cpu()):
    return np.asarray(_half_to_float32(half))


_half_to_float32 = jax.jit(lambda half: half.astype(jnp.float32))
_host_cpu = functools.cache(lambda: jax.devices("cpu")[0])


def _scoring_threads(rows: int) -> int:
  """How many threads score `rows` distinct tokens (`token_scores`): as many as faiss may use
  (OpenMP's count: the cores, or OMP_NUM_THREADS), at most _RESCORE_THREADS and one per
  _RESCORE_ROWS_PER_THREAD rows; one without threadpoolctl (BLAS then keeps its threads)."""
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
  vectors goes through memory. Codes of a product quantizer: `_score_looked_up`; other
  sources (the dump's float16, other codes): `_score_converted`."""
  if getattr(source, "tables", None) is not None:
    _score_looked_up(source, token, queries, bounds, scores, first, last)
    return
  if not isinstance(source, np.ndarray) or source.dtype != np.float32:
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
  """`_score_questions` from rows to convert (the dump's float16, a compact index's codes:
  `_stored`): the rows of consecutive questions, up to `CONVERT_ROWS`, are gathered into one
  buffer and converted by one call (float16: of one shape, `half_to_float32`); a question with
  more rows is converted alone, in such pieces. Each question's product is the same
  [max(U_q, 2), D] x [D, 2] one, bit for bit."""
  source, convert, dim = _stored(source)
  half = np.zeros((CONVERT_ROWS, source.shape[1]), source.dtype)
  q = first
  while q < last:
    lo = bounds[q]
    # The questions whose rows end within the chunk, one row spare (two rows a product).
    end = min(max(int(np.searchsorted(bounds, lo + CONVERT_ROWS - 1, "right")) - 1, q + 1),
              last)
    hi = bounds[end]
    if hi - lo < CONVERT_ROWS:
      np.take(source, token[lo:hi], axis=0, out=half[:hi - lo], mode="clip")
      rows = convert(half, hi - lo + 1, token[lo:hi])  # (one row spare: see above)
    else:  # one question of more rows than a chunk
      rows = np.empty((hi - lo, dim), np.float32)
      for at in range(0, hi - lo, CONVERT_ROWS):
        n = min(CONVERT_ROWS, hi - lo - at)
        np.take(source, token[lo + at:lo + at + n], axis=0, out=half[:n], mode="clip")
        rows[at:at + n] = convert(half, n, token[lo + at:lo + at + n])[:n]
    for p in range(q, end):
      a, b = bounds[p] - lo, bounds[p + 1] - lo
      scores[lo + a:lo + b] = (rows[a:max(b, a + 2)] @ queries[p])[:b - a]
    q = end


def _score_looked_up(source, token: np.ndarray, queries: np.ndarray, bounds: np.ndarray,
                     scores: np.ndarray, first: int, last: int) -> None:
  """`_score_questions` from a compact index's codes scored by lookup tables
  (`CodedVectors.scores`): each question's rows' codes gathered and scored under its queries."""
  for q in range(first, last):
    lo, hi = bounds[q], bounds[q + 1]
    if hi > lo:
      codes = np.take(source.codes, token[lo:hi], axis=0, mode="clip")
      scores[lo:hi] = source.scores(codes, token[lo:hi], queries[q])


def _stored(source) -> tuple:
  """(the stored rows, their conversion `convert(buffer, n, ids)` -> float32 [>= n, D] of the
  buffer's first n rows, those of row ids `ids`, D) of a rescoring's source: the dump's float16
  rows (the whole buffer converted: one shape, compiled once) or a compact index's codes
  (`compact.CodedVectors`: those n rows decoded, in its coded space)."""
  if isinstance(source, np.ndarray):
    return source, lambda half, n, ids: half_to_float32(half), source.shape[1]
  return source.codes, lambda codes, n, ids: source.decode(codes[:n], ids[:n]), source.dim


def token_scores(source: np.ndarray, tokens: np.ndarray, q_start: np.ndarray,
                 q_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(start scores, end scores) of token ids [Q, ...] under their question's vectors, from
  `source` [N, D] (row = token id): an exact index's own float32 storage when it holds every
  token (`PhraseIndex._exact_vectors`), a compact index's codes, else the dump's rows.

  Hits of one question crowd into few passages, so each distinct (question, token) is scored
  once, a question at a time (`_score_questions`). The questions are split into contiguous
  groups scored in as many threads as faiss may use (`_scoring_threads`), with BLAS and faiss
  (OpenMP) held at one thread: their idle threads would spin on the cores the others need. A
  question's scores come from the same product, bit for bit, whichever thread computes it."""
  num_q, n = len(q_start), len(source)
  if not isinstance(source, np.ndarray):  # a compact index's codes: its queries' space
    q_start, q_end = source.queries(q_start), source.queries(q_end)
  keys = np.arange(num_q)[:, None] * n + tokens.reshape(num_q, -1)
  unique, inverse = np.unique(keys, return_inverse=True)
  question, token = np.divmod(unique, n)
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
