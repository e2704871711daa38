"""Passage-residual and question-weighted codes of a compact index, and their passage-first search.

`compact:pr:<codec>` stores each passage's mean kept vector once, coded by a second codec
(`passage_means.npy`, `means_codec.faiss`), and each kept token's residual from its passage's
decoded mean, coded by `<codec>` (`codes.npy`): the mean holds most of a token's energy (91% on
SQuAD-open, results/codec_scores.md), so the token codes spend their bytes on what tells a
passage's tokens apart. `qw+pr:` codes both in the question-weighted space x -> x W (W = C^1/2,
C the second moment of training questions' vectors, `weighting.npy`) and maps queries
q -> q W^-1, so that a code's squared error is the expected squared error of a question's
score; `qw:` weights without residuals.

A residual index is searched passage first (`PassageFirstSearch`): the queries score every
passage's coded mean, then the kept tokens of their top `nprobe` passages by mean plus residual
(`q . m_p + q . r_t`, lookup tables of the residual codec's PQ centroids): an IVF index whose
lists are the passages, each list a passage's contiguous kept ranks, so no id is stored.
"""
from __future__ import annotations

import dataclasses
import pathlib

import faiss
import numpy as np

from dpjax.errors import ConfigError, DumpError
from dpjax.io import file_digest, save_npy_atomic, write_bytes_atomic

MODIFIERS = ("qw", "pr")
MEANS = "passage_means.npy"
MEANS_CODEC = "means_codec.faiss"
WEIGHTING = "weighting.npy"
# PQ's 256-centroid codebooks want about 39 x 256 training vectors: fewer passages keep their
# means exactly (float16); more code them with OPQ and 12-dimensional PQ sub-vectors (32 bytes
# at D = 384). The means' coding error shifts every token of a passage alike, so it must stay
# below the tokens' own, which plain PQ's does not (docs/indexing.md).
PQ_MEANS_MIN_PASSAGES = 39 * 256
MEANS_SUBVECTOR_DIMS = 12
# Training vectors drawn for each codec: faiss's k-means samples 256 per centroid (65,536 for an
# 8-bit PQ) and OPQ as many, so a larger sample only costs memory.
TRAIN_SAMPLE = 1 << 17
CHUNK = 1 << 16  # tokens coded at a time: bounded float32 copies
_EIGEN_FLOOR = 1e-6  # C's eigenvalues floored at this share of the largest (C^-1/2 stays finite)


def parse(codec_spec: str) -> tuple[frozenset, str]:
  """({"qw", "pr"} modifiers, faiss factory string: "" for the default) of a compact codec
  "[qw|pr|qw+pr:]<codec>"; a ConfigError names an unknown modifier."""
  head, sep, codec = codec_spec.partition(":")
  if not sep:
    return frozenset(), codec_spec
  mods = head.split("+")
  if not set(mods) <= set(MODIFIERS) or len(set(mods)) != len(mods):
    raise ConfigError(f"index.specs: compact codec {codec_spec!r}: modifiers before ':' are "
                      f"'qw', 'pr' or 'qw+pr' (question-weighted, passage residuals)")
  return frozenset(mods), codec


def joined(mods, codec: str) -> str:
  """The compact codec string of modifiers `mods` and a faiss factory string: "qw+pr:OPQ24,PQ24"
  (`parse`'s inverse, the modifiers in MODIFIERS' order)."""
  head = "+".join(m for m in MODIFIERS if m in mods)
  return f"{head}:{codec}" if head else codec


def means_codec_spec(num_passages: int, dim: int) -> str:
  """The codec of the passages' means: float16 below PQ_MEANS_MIN_PASSAGES passages, else OPQ
  and PQ of MEANS_SUBVECTOR_DIMS-dimensional sub-vectors."""
  if num_passages < PQ_MEANS_MIN_PASSAGES:
    return "SQfp16"
  m = max(1, dim // MEANS_SUBVECTOR_DIMS)
  while dim % m:
    m -= 1
  return f"OPQ{m},PQ{m}"


@dataclasses.dataclass(frozen=True)
class Weighting:
  """The question-weighted space: tokens x -> x root, queries q -> q inverse (root = C^1/2,
  symmetric; q . x = q inverse . x root)."""

  root: np.ndarray  # [D, D] float32
  inverse: np.ndarray  # [D, D] float32

  @classmethod
  def of_questions(cls, vectors: np.ndarray) -> "Weighting":
    """The weighting of questions' vectors [n, D] (their start and end vectors alike)."""
    q = np.asarray(vectors, np.float64)
    if not len(q) or not np.isfinite(q).all():
      raise ConfigError("index.specs: question weighting (qw:) needs finite question vectors; "
                        f"got {len(q)} vectors")
    values, vectors = np.linalg.eigh(q.T @ q / len(q))
    values = np.maximum(values, values.max() * _EIGEN_FLOOR)
    return cls.of_root((vectors * np.sqrt(values)) @ vectors.T)

  @classmethod
  def of_root(cls, root: np.ndarray) -> "Weighting":
    """The weighting of its root [D, D] (`weighting.npy`), inverted in float64."""
    root = np.asarray(root, np.float32)
    return cls(root, np.linalg.inv(root.astype(np.float64)).astype(np.float32))

  def tokens(self, x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32) @ self.root

  def queries(self, q: np.ndarray) -> np.ndarray:
    return np.asarray(q, np.float32) @ self.inverse


def add_passage_sums(sums: np.ndarray, vectors: np.ndarray, passages: np.ndarray) -> None:
  """Adds float32 `vectors` [n, D] into `sums` [P, D] (float64) at their passage rows
  `passages` [n], which do not decrease (a dump's token order)."""
  if not len(passages):
    return
  starts = np.flatnonzero(np.r_[True, passages[1:] != passages[:-1]])
  sums[passages[starts]] += np.add.reduceat(vectors.astype(np.float64), starts, axis=0)


def means_of(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
  """[P, D] float32 means of `sums` over `counts` [P] (zeros for a passage without tokens)."""
  return (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)


class ResidualCodes:
  """A residual compact index's coding: `codec` codes the tokens (their residuals from their
  passage's decoded mean, with `means_codec`; else the tokens themselves), in the weighted space
  of `weighting` (None: the tokens' own)."""

  def __init__(self, codec, means_codec=None, weighting: Weighting | None = None):
    self.codec, self.means_codec, self.weighting = codec, means_codec, weighting

  def space(self, x: np.ndarray) -> np.ndarray:
    """float32 vectors [n, D] in the space the codes are of."""
    return self.weighting.tokens(x) if self.weighting is not None else np.asarray(x, np.float32)

  def train(self, sample: np.ndarray, sample_means: np.ndarray | None,
            means_sample: np.ndarray | None) -> None:
    """Trains the means codec on `means_sample` [m, D], then the token codec on the residuals
    of `sample` [n, D] from their passages' means `sample_means` [n, D] as decoded (all in the
    coded space)."""
    if self.means_codec is not None:
      if not self.means_codec.is_trained:
        self.means_codec.train(np.ascontiguousarray(means_sample))
      sample = sample - self.decode_means(self.encode_means(sample_means))
    self.codec.train(np.ascontiguousarray(sample))

  def encode_means(self, means: np.ndarray) -> np.ndarray:
    return self.means_codec.sa_encode(np.ascontiguousarray(means, np.float32))

  def decode_means(self, codes: np.ndarray) -> np.ndarray:
    return self.means_codec.sa_decode(np.ascontiguousarray(codes))

  def encode(self, x: np.ndarray, means: np.ndarray | None) -> np.ndarray:
    """Codes [n, C] of tokens `x` [n, D] (coded space) whose passages' decoded means are
    `means` [n, D] (None: no residuals)."""
    return self.codec.sa_encode(np.ascontiguousarray(x if means is None else x - means))

  def passage_means(self, vectors, rows: np.ndarray, passages: np.ndarray,
                    num_passages: int) -> np.ndarray:
    """[num_passages, D] each passage's mean token in the coded space (zeros for one without
    tokens), of the tokens `vectors[rows]` (any array of vectors, memory mapped or not, read
    CHUNK rows at a time) whose passages `passages` [K] do not decrease."""
    sums = np.zeros((num_passages, vectors.shape[1]), np.float64)
    for lo in range(0, len(rows), CHUNK):
      add_passage_sums(sums, self.space(vectors[rows[lo:lo + CHUNK]]), passages[lo:lo + CHUNK])
    return means_of(sums, np.bincount(passages, minlength=num_passages))

  def shard_codes(self, vectors, rows: np.ndarray, passages: np.ndarray,
                  num_passages: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(the passages' coded means [num_passages, Cm], None without residuals; the tokens'
    codes [K, C]) of a shard's tokens `vectors[rows]` of passages `passages` [K] (as
    `passage_means`), CHUNK rows at a time: a passage's mean needs all its tokens first."""
    mean_codes = means = None
    if self.means_codec is not None:
      mean_codes = self.encode_means(self.passage_means(vectors, rows, passages, num_passages))
      means = self.decode_means(mean_codes)
    codes = np.empty((len(rows), self.codec.sa_code_size()), np.uint8)
    for lo in range(0, len(rows), CHUNK):
      part = rows[lo:lo + CHUNK]
      codes[lo:lo + len(part)] = self.encode(
          self.space(vectors[part]), None if means is None else means[passages[lo:lo + len(part)]])
    return mean_codes, codes

  def write(self, directory: pathlib.Path, codec_name: str) -> dict[str, str]:
    """Writes the coding's files into `directory` (each atomically; the codec `codec_name`
    last); returns their digests by name."""
    files = {}
    if self.means_codec is not None:
      write_bytes_atomic(directory / MEANS_CODEC, faiss.serialize_index(self.means_codec))
      files[MEANS_CODEC] = file_digest(directory / MEANS_CODEC)
    if self.weighting is not None:
      save_npy_atomic(directory / WEIGHTING, self.weighting.root)
      files[WEIGHTING] = file_digest(directory / WEIGHTING)
    write_bytes_atomic(directory / codec_name, faiss.serialize_index(self.codec))
    files[codec_name] = file_digest(directory / codec_name)
    return files

  @classmethod
  def read(cls, directory: pathlib.Path, files: dict[str, str], codec_name: str,
           again: str) -> "ResidualCodes":
    """The coding written in `directory` (`write`), each file checked against its digest in
    `files`; a DumpError names a missing or changed one and says what to do (`again`)."""
    for name, digest in files.items():
      if not (directory / name).is_file() or file_digest(directory / name) != digest:
        raise DumpError(f"{directory / name}: missing or not the file the codes were made "
                        f"with; {again}")
    return cls(faiss.read_index(str(directory / codec_name)),
               faiss.read_index(str(directory / MEANS_CODEC)) if MEANS_CODEC in files else None,
               Weighting.of_root(np.load(directory / WEIGHTING)) if WEIGHTING in files else None)


class PassageFirstSearch:
  """The search of a residual compact index: passages by their coded means, then the kept
  tokens of each query's top `nprobe` passages, scored mean plus residual.

  Args:
    means: a flat-code search of the passages' means (`compact.CodeSearch`; labels: rows).
    codec: the residual codec (faiss, trained): PQ (after OPQ) of 8 bits scores by lookup
      tables, any other flat codec by decoding the visited tokens.
    codes: [K, C] the kept tokens' residual codes (rank order).
    kept_offsets: [P + 1] each passage row's first kept rank.
    weighting: the queries' map (None: unweighted).
    nprobe: passages visited per query.
  """

  def __init__(self, means, codec, codes: np.ndarray, kept_offsets: np.ndarray,
               weighting: Weighting | None, nprobe: int):
    self.means, self.codec, self.codes = means, codec, codes
    self.kept_offsets, self.weighting = kept_offsets, weighting
    self.nprobe = max(1, int(nprobe))
    self._tables = _pq_tables(codec)

  @property
  def ntotal(self) -> int:
    return len(self.codes)

  def search(self, queries: np.ndarray, k: int):
    """(scores, labels) [Q, k] of the queries' best kept tokens (ranks; -1 and -inf past the
    tokens of their visited passages)."""
    q = np.ascontiguousarray(queries, np.float32)
    if self.weighting is not None:
      q = self.weighting.queries(q)
    num_passages = len(self.kept_offsets) - 1
    mean_scores, passages = self.means.search(q, min(self.nprobe, num_passages))
    scores = np.full((len(q), k), -np.inf, np.float32)
    labels = np.full((len(q), k), -1, np.int64)
    tables = self._tables(q) if self._tables is not None else None
    for i in range(len(q)):
      found = passages[i] >= 0
      ranks, lengths = self._ranks(passages[i][found])
      if not len(ranks):
        continue
      codes = np.asarray(self.codes[ranks])
      if tables is not None:  # (sub-quantizer m's table row, at each token's code m)
        residual = tables[i][np.arange(codes.shape[1]), codes].sum(1)
      else:
        residual = self.codec.sa_decode(codes) @ q[i]
      total = np.repeat(mean_scores[i][found], lengths) + residual
      top = _top(total, k)
      scores[i, :len(top)], labels[i, :len(top)] = total[top], ranks[top]
    return scores, labels

  def _ranks(self, passages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the kept ranks of `passages`, in their order; each passage's count of them)."""
    first = np.asarray(self.kept_offsets[passages], np.int64)
    lengths = np.asarray(self.kept_offsets[passages + 1], np.int64) - first
    total = int(lengths.sum())
    # rank = first of its passage + its place: a running count shifted at each passage's start
    shift = np.repeat(first - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(total, dtype=np.int64) + shift, lengths


def _top(scores: np.ndarray, k: int) -> np.ndarray:
  """Positions of the k best of `scores`, best first (all, when fewer)."""
  if len(scores) > k:
    part = np.argpartition(-scores, k - 1)[:k]
    return part[np.argsort(-scores[part], kind="stable")]
  return np.argsort(-scores, kind="stable")


def _pq_tables(codec):
  """queries [Q, D] -> [Q, M, 256] their inner products with each of the codec's M 256-entry
  codebooks, where a token's score is the sum over m of its row m at its code byte m
  (`byte_codebooks`; the codec's transforms applied to the queries first, as faiss's own search
  of the codec applies them: exact for an orthonormal one such as OPQ's rotation); None for other
  codecs (scored by decoding)."""
  found = byte_codebooks(codec)
  if found is None:
    return None
  transforms, codebooks, summed = found
  m, ksub, width = codebooks.shape
  if summed:  # an additive quantizer: full-width codebooks
    flat = codebooks.reshape(m * ksub, width)
    products = lambda q: (q @ flat.T).reshape(len(q), m, ksub)
  else:  # PQ: sub-vector m against codebook m
    products = lambda q: np.einsum("qmd,mkd->qmk", q.reshape(len(q), m, width), codebooks)

  def tables(q: np.ndarray) -> np.ndarray:
    for transform in transforms:
      q = transform.apply(np.ascontiguousarray(q))
    return products(np.ascontiguousarray(q, np.float32))
  return tables


def byte_codebooks(codec) -> tuple[list, np.ndarray, bool] | None:
  """(the codec's pre-transforms in order, codebooks [M, 256, w], summed) of a codec whose code
  byte m picks entry m of codebook m, a token's vector the transforms undone on the entries'
  concatenation (PQ of 8 bits: w = D / M, summed False) or sum (an additive quantizer of 8-bit
  stages without stored norms, `_additive_bytes`: w = D, summed True); None for other codecs."""
  index = faiss.downcast_index(codec)
  transforms = []
  if isinstance(index, faiss.IndexPreTransform):
    transforms = [faiss.downcast_VectorTransform(index.chain.at(i))
                  for i in range(index.chain.size())]
    index = faiss.downcast_index(index.index)
  if type(index) is faiss.IndexPQ and index.pq.nbits == 8:
    pq = index.pq
    return (transforms, faiss.vector_to_array(pq.centroids).reshape(pq.M, pq.ksub, pq.dsub),
            False)
  if _additive_bytes(index):
    aq = index.aq
    return transforms, faiss.vector_to_array(aq.codebooks).reshape(aq.M, 256, aq.d), True
  return None


def _additive_bytes(index) -> bool:
  """Whether `index` is an additive quantizer of full-width codebooks (RQ, LSQ; not their
  product forms, whose codebooks span sub-vectors) whose code is one byte per codebook (8-bit
  stages, no stored norm): byte m is stage m's entry."""
  if not isinstance(index, (faiss.IndexResidualQuantizer, faiss.IndexLocalSearchQuantizer)):
    return False
  aq = index.aq
  return (aq.norm_bits == 0 and aq.code_size == aq.M
          and all(aq.nbits.at(m) == 8 for m in range(aq.M))
          and aq.codebooks.size() == aq.M * 256 * aq.d)
