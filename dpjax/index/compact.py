"""The compact index kind (`compact:<codec>` in `index.specs`): a dump's kept tokens encoded once
by a faiss codec, searched and rescored from those codes alone, without the dump's token arrays
or its passages.

`<codec>` is a faiss factory string whose index stores flat codes (`IndexFlatCodes`, after an
optional transform): `PQ<m>`, `OPQ<m>,PQ<m>`, `SQ4`, `SQ8`, `SQfp16` (the dump's float16
values, exactly), `Flat`. The index folder (`faiss_index.build_index` writes it) holds:

  codec.faiss          the trained codec, empty
  codes.npy            [K, C] uint8   each kept token's code (`sa_encode`), in token order
  char_spans.npy       [K, 2] uint16  (int32 where a passage is longer) characters of each token
  positions.npy        [K] uint16     (int32 where a passage has more tokens) each kept token's
                                      place among its passage's dump tokens; only where some
                                      are not kept (a filter threshold, at index or dump time)
  passage_offsets.npy  [P + 1] int64  each passage row's first token id in the dump
  kept_offsets.npy     [P + 1] int64  each passage row's first kept token (rank)
  passages.bin, passage_blocks.npy, passage_documents.npy
                                      the passages (`passage_store`)
  passage_means.npy    [P, Cm] uint8  each passage's mean kept vector, coded (`residual`: a
  means_codec.faiss                   codec "pr:<codec>" codes the tokens' residuals from them)
  weighting.npy        [D, D] float32 the question weighting ("qw:<codec>", `residual`)
  index_manifest.json  `"kind": "compact"`, the codec, the bytes of each part

Its tokens are numbered by rank among the kept ones (faiss labels, the `Phrase` token ids of a
search), so that every per-token array holds kept tokens only; a passage's kept tokens are
contiguous ranks, so the offsets give the passage of a rank (`TokenPassages`) and the positions
its dump token id (`token_ids`). Every part is memory mapped: loading reads the offsets, builds
no array of one entry per token, and a search reads the codes, spans, positions and passages it
needs. The codes are stored once: the faiss index that searches them (exhaustively, by the
codec's own asymmetric distance) views the memory-mapped `codes.npy` (`searcher`), and the
rescoring decodes the rows it needs from it (`CodedVectors`). A residual index ("pr:") is
searched passage first (`residual.PassageFirstSearch`).
"""
from __future__ import annotations

import dataclasses
import pathlib

import faiss
import numpy as np

from dpjax.errors import ConfigError, DumpError
from dpjax.index import passage_store, residual
from dpjax.index.rescoring import Rescorer, TokenPassages

PREFIX = "compact:"
# The codec of a bare "compact": 16-dimensional PQ sub-vectors after an OPQ rotation, the ratio
# of DensePhrases' own OPQ96 over 1,536 dimensions; `default_codec` fills in the dimension.
DEFAULT_SUBVECTOR_DIMS = 16
PARTS = ("codes.npy", "char_spans.npy", "positions.npy", "passage_offsets.npy",
         "kept_offsets.npy", *passage_store.FILES, "codec.faiss", residual.MEANS,
         residual.MEANS_CODEC, residual.WEIGHTING)
REBUILD = "build the index again with `run.py index`"


def is_compact(spec: str) -> bool:
  """Whether an `index.specs` entry names a compact index ("compact" or "compact:<codec>")."""
  return spec == PREFIX[:-1] or spec.startswith(PREFIX)


def default_codec(dim: int) -> str:
  """The codec of a bare "compact" for `dim`-dimensional vectors: OPQ<m>,PQ<m>, m = dim / 16."""
  m = max(1, dim // DEFAULT_SUBVECTOR_DIMS)
  while dim % m:
    m -= 1
  return f"OPQ{m},PQ{m}"


def codec_spec(spec: str, dim: int) -> str:
  """The codec of a compact spec: "[qw|pr|qw+pr:]<faiss factory string>" (`residual.parse`)."""
  codec = spec[len(PREFIX):] if spec.startswith(PREFIX) else ""
  mods, factory = residual.parse(codec)
  return residual.joined(mods, factory or default_codec(dim))


def flat_codes(codec):
  """The `IndexFlatCodes` that stores a codec's codes (inside an `IndexPreTransform`), or a
  ConfigError naming the codec when it stores none (IVF, HNSW: they are not one array)."""
  inner = faiss.downcast_index(codec)
  if isinstance(inner, faiss.IndexPreTransform):
    inner = faiss.downcast_index(inner.index)
  if not isinstance(inner, faiss.IndexFlatCodes):
    raise ConfigError(f"index.specs: a compact index needs a codec of flat codes (PQ, OPQ+PQ, SQ, "
                      f"Flat), not {type(inner).__name__}")
  return inner


class CodedVectors:
  """[K, D] token vectors held as codes [K, C], rows decoded on demand (the rescoring's
  `scoring.token_scores` gathers code rows and calls `decode`), in the codes' space: a residual
  index's rows add their passage's decoded mean, a weighted index's are x W and its queries
  map by W^-1 (`queries`), so that scores are the original ones."""

  def __init__(self, codes: np.ndarray, codec, *, passages: TokenPassages | None = None,
               means: np.ndarray | None = None, means_codec=None,
               weighting: residual.Weighting | None = None):
    self.codes, self.codec, self.dim = codes, codec, codec.d
    self.passages, self.means, self.means_codec = passages, means, means_codec
    self.weighting = weighting
    self.tables = lookup_tables(codec)  # None: rows are decoded to be scored

  def __len__(self) -> int:
    return len(self.codes)

  def decode(self, codes: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """[n, D] float32 vectors (the codes' space) of `codes` [n, C], the rows of kept ranks `ids`
    (a residual index: their passages' means added; rows past len(ids) get none)."""
    rows = self.codec.sa_decode(np.ascontiguousarray(codes))
    if self.means is not None and len(rows):
      passages = self.passages[np.asarray(ids, np.int64)]
      unique, inverse = np.unique(passages, return_inverse=True)
      decoded = self.means_codec.sa_decode(np.ascontiguousarray(self.means[unique]))
      rows[:len(passages)] += decoded[inverse]
    return rows

  def scores(self, codes: np.ndarray, ids: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """[n, J] float32 inner products of the rows `codes` [n, C] (kept ranks `ids`) with query
    vectors `queries` [D, J] (the codes' space), from lookup tables (needs `tables`): each
    query rotated once, a table of its products with every codebook's entries, and a row's
    score the sum of its codes' entries, with no row decoded; a residual index adds the product
    with the row's passage mean. The same as the decoded rows' products up to float32 rounding;
    a row's score depends on its code, passage and the queries only."""
    rotation, codebooks, summed = self.tables
    m, _, width = codebooks.shape
    turned = queries if rotation is None else rotation @ queries  # [D, J] in the codes' space
    # [M, 256, J]: entry k of codebook m against the queries (PQ: their sub-vector m)
    table = np.matmul(codebooks, turned if summed else turned.reshape(m, width, -1))
    out = table[np.arange(m), np.asarray(codes, np.intp)].sum(1, dtype=np.float32)
    if self.means is not None and len(ids):
      unique, inverse = np.unique(self.passages[np.asarray(ids, np.int64)], return_inverse=True)
      means = self.means_codec.sa_decode(np.ascontiguousarray(self.means[unique]))
      # (einsum: each product summed alone, the same bits however many passages; a BLAS
      # product of one row, a gemv, rounds otherwise)
      out += np.einsum("pd,dj->pj", means, queries)[inverse]
    return out

  def queries(self, q: np.ndarray) -> np.ndarray:
    """Query vectors [n, D] mapped into the codes' space (weighted: q W^-1)."""
    return q if self.weighting is None else self.weighting.queries(q)

  def original(self, ids: np.ndarray) -> np.ndarray:
    """[n, D] float32 decoded vectors of kept ranks `ids` in the dump's space (QSFT's
    candidates: a weighted index's rows mapped back, x W W^-1)."""
    ids = np.asarray(ids, np.int64)
    rows = self.decode(np.asarray(self.codes[ids]), ids)
    return rows if self.weighting is None else rows @ self.weighting.inverse


def lookup_tables(codec) -> tuple[np.ndarray | None, np.ndarray, bool] | None:
  """(rotation [D, D] or None, codebooks [M, 256, w], summed: `residual.byte_codebooks`) of a
  codec whose codes are scored from lookup tables (`CodedVectors.scores`): 8-bit PQ or additive
  codes, alone or behind one orthonormal transform without bias (OPQ), which keeps inner
  products, so that the scores are exact; None for any other codec."""
  found = residual.byte_codebooks(codec)
  if found is None or len(found[0]) > 1:
    return None
  rotation = None
  if found[0]:
    transform = found[0][0]
    if not (isinstance(transform, faiss.LinearTransform) and transform.is_orthonormal
            and not transform.have_bias and transform.d_in == transform.d_out):
      return None
    rotation = faiss.vector_to_array(transform.A).reshape(transform.d_out, transform.d_in)
  return rotation, found[1], found[2]


@dataclasses.dataclass
class CompactIndex:
  """A compact index folder, loaded: its arrays memory mapped, its passages a `PassageStore`."""

  directory: pathlib.Path
  manifest: dict
  codec: object  # the trained, empty faiss codec
  codes: np.ndarray  # [K, C] uint8
  char_spans: np.ndarray  # [K, 2]
  positions: np.ndarray | None  # [K] each kept token's place in its passage (None: all kept)
  passage_offsets: np.ndarray  # [P + 1] int64 each passage row's first dump token id
  kept_offsets: np.ndarray  # [P + 1] int64 each passage row's first kept rank
  passages: passage_store.PassageStore
  means: np.ndarray | None = None  # [P, Cm] uint8 the passages' coded means (a residual index)
  means_codec: object = None
  weighting: residual.Weighting | None = None

  @classmethod
  def load(cls, directory: pathlib.Path, manifest: dict, num_passages: int) -> "CompactIndex":
    """The index in `directory` (its files' sizes and digests checked before: `check_index`);
    a DumpError when a part is unreadable or of other shapes than the manifest records."""
    if passage_store.DATA not in manifest.get("parts", {}):
      raise DumpError(f"{directory}: a compact index of an older layout (the dump's passages, "
                      f"kept bits); {REBUILD}")
    try:
      codec = faiss.read_index(str(directory / "codec.faiss"))
    except RuntimeError as e:
      raise DumpError(f"{directory / 'codec.faiss'}: unreadable ({str(e).splitlines()[0]}); "
                      f"{REBUILD}") from None
    kept, tokens = manifest["num_tokens"], manifest["dump_tokens"]
    codes = _array(directory, "codes.npy", (kept, flat_codes(codec).code_size))
    spans = _array(directory, "char_spans.npy", (kept, 2))
    positions = None
    if manifest.get("positions"):
      positions = _array(directory, "positions.npy", (kept,))
    elif kept != tokens:
      raise DumpError(f"{directory / 'positions.npy'}: missing, and {kept} of {tokens} tokens "
                      f"are kept; {REBUILD}")
    return cls(directory, manifest, codec, codes, spans, positions,
               _offsets(directory, "passage_offsets.npy", num_passages, tokens),
               _offsets(directory, "kept_offsets.npy", num_passages, kept),
               passage_store.PassageStore(directory, num_passages),
               *_residual_parts(directory, manifest, num_passages, codec.d))

  @property
  def vectors(self) -> CodedVectors:
    return CodedVectors(self.codes, self.codec, passages=self.token_passage, means=self.means,
                        means_codec=self.means_codec, weighting=self.weighting)

  @property
  def token_passage(self) -> TokenPassages:
    """The passage row of kept-token ranks (`token_passage[ranks]`), from the kept offsets."""
    return TokenPassages(self.kept_offsets)

  def rescorer(self) -> Rescorer:
    """The exact rescoring of the kept tokens from their codes (`Rescorer.over_offsets`)."""
    return Rescorer.over_offsets(self.vectors, self.kept_offsets, self.positions)

  def searcher(self, nprobe: int | None = None):
    """The search of the codes (labels: kept-token ranks): a faiss index of the codec whose
    codes are `codes.npy`'s memory, not a copy (`CodeSearch`, its queries weighted where the
    codes are); a residual index's passage-first search of `nprobe` passages (default: the
    manifest's)."""
    if self.means is not None:
      return residual.PassageFirstSearch(
          CodeSearch.over(self.means_codec, self.means), self.codec, self.codes,
          self.kept_offsets, self.weighting, nprobe or self.manifest["nprobe"])
    return CodeSearch.over(self.codec, self.codes, self.weighting)

  def token_ids(self, ranks: np.ndarray) -> np.ndarray:
    """The dump token ids of kept-token ranks (search results' `start_token` / `end_token`):
    their passage's first dump token id plus their place in it."""
    ranks = np.asarray(ranks, np.int64)
    if self.positions is None:
      return ranks
    return self.passage_offsets[self.token_passage[ranks]] + np.asarray(self.positions[ranks],
                                                                        np.int64)


class CodeSearch:
  """A faiss index over codes it views but does not own, and what keeps them alive; queries
  mapped by `weighting` first (None: as given)."""

  def __init__(self, index, keep: tuple, weighting: residual.Weighting | None = None):
    self.index, self._keep, self.weighting = index, keep, weighting

  @classmethod
  def over(cls, codec, codes: np.ndarray,
           weighting: residual.Weighting | None = None) -> "CodeSearch":
    """The exhaustive search of `codes` [n, C] (memory mapped, viewed) by `codec`'s own
    asymmetric distance (labels: rows)."""
    index = faiss.clone_index(codec)
    inner = flat_codes(index)
    # A view needs an owner argument: a null one (the memory map is `CodeSearch`'s to keep).
    empty = faiss.MaybeOwnedVectorUInt8()
    inner.codes = faiss.MaybeOwnedVectorUInt8.create_view(faiss.swig_ptr(codes), codes.size,
                                                          empty.owner)
    inner.ntotal = index.ntotal = len(codes)
    return cls(index, (codes, empty, inner), weighting)

  @property
  def ntotal(self) -> int:
    return self.index.ntotal

  def search(self, queries: np.ndarray, k: int):
    """faiss's (scores, labels) [Q, k] of the codes' exhaustive search (labels: ranks)."""
    if self.weighting is not None:
      queries = self.weighting.queries(queries)
    return self.index.search(np.ascontiguousarray(queries, np.float32), k)


def _array(directory: pathlib.Path, name: str, shape: tuple) -> np.ndarray:
  """A part of the index, memory mapped, refused (DumpError) unless of `shape`."""
  path = directory / name
  try:
    array = np.load(path, mmap_mode="r")
  except (OSError, ValueError) as e:
    raise DumpError(f"{path}: unreadable ({type(e).__name__}: {e}); {REBUILD}") from None
  if array.shape != shape:
    raise DumpError(f"{path}: of shape {array.shape}, {shape} expected; {REBUILD}")
  return array


def _offsets(directory: pathlib.Path, name: str, num_passages: int, total: int) -> np.ndarray:
  """Passages' first tokens [P + 1], memory mapped, refused (DumpError) unless they rise from 0
  to `total`."""
  offsets = _array(directory, name, (num_passages + 1,))
  if offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
    raise DumpError(f"{directory / name}: not the offsets of {total} tokens; {REBUILD}")
  return offsets


def _residual_parts(directory: pathlib.Path, manifest: dict, num_passages: int,
                    dim: int) -> tuple:
  """(coded means [P, Cm], their codec, the weighting) of a residual / weighted index (Nones
  where it has none)."""
  means = means_codec = weighting = None
  if manifest.get("residual"):
    path = directory / residual.MEANS_CODEC
    try:
      means_codec = faiss.read_index(str(path))
    except RuntimeError as e:
      raise DumpError(f"{path}: unreadable ({str(e).splitlines()[0]}); {REBUILD}") from None
    means = _array(directory, residual.MEANS,
                   (num_passages, flat_codes(means_codec).code_size))
  if manifest.get("weighted"):
    weighting = residual.Weighting.of_root(_array(directory, residual.WEIGHTING, (dim, dim)))
  return means, means_codec, weighting


def span_dtype(last_char: int) -> np.dtype:
  """uint16 character offsets when no token ends past 65,535 characters, else int32."""
  return np.dtype(np.uint16 if last_char < (1 << 16) else np.int32)


def part_bytes(directory: pathlib.Path, dump_tokens: int) -> dict:
  """{part: {"bytes", "per_token"}} of an index folder's parts, per dump token."""
  out = {}
  for name in PARTS:
    if (directory / name).is_file():
      size = (directory / name).stat().st_size
      out[name] = {"bytes": size, "per_token": size / max(dump_tokens, 1)}
  return out
