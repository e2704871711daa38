"""The compact index kind (`compact:<codec>` in `index.specs`): a dump's kept tokens encoded once
by a faiss codec, searched and rescored from those codes alone, without the dump's token arrays.

`<codec>` is a faiss factory string whose index stores flat codes (`IndexFlatCodes`, after an
optional transform): `PQ<m>`, `OPQ<m>,PQ<m>`, `SQ4`, `SQ8`, `SQfp16` (the dump's float16
values, exactly), `Flat`. The index folder (`faiss_index.build_index` writes it) holds:

  codec.faiss          the trained codec, empty
  codes.npy            [K, C] uint8   each kept token's code (`sa_encode`), in token order
  char_spans.npy       [K, 2] uint16  (int32 where a passage is longer) characters of each token
  passage_offsets.npy  [P + 1] int64  each passage row's first token id in the dump
  kept.npy             [ceil(T / 8)] uint8  which dump tokens are kept (`np.packbits`); only
                                      with a filter threshold (else every token is)
  index_manifest.json  `"kind": "compact"`, the codec, the bytes of each part

Its tokens are numbered by rank among the kept ones (faiss labels, the `Phrase` token ids of a
search), so that every per-token array holds kept tokens only. The codes are stored once: the
faiss index that searches them (exhaustively, by the codec's own asymmetric distance) views the
memory-mapped `codes.npy` (`searcher`), and the rescoring decodes the rows it needs from it
(`CodedVectors`).
"""
from __future__ import annotations

import dataclasses
import pathlib

import faiss
import numpy as np

from dpjax.errors import ConfigError, DumpError

PREFIX = "compact:"
# The codec of a bare "compact": 16-dimensional PQ sub-vectors after an OPQ rotation, the ratio
# of DensePhrases' own OPQ96 over 1,536 dimensions; `default_codec` fills in the dimension.
DEFAULT_SUBVECTOR_DIMS = 16
PARTS = ("codes.npy", "char_spans.npy", "passage_offsets.npy", "kept.npy", "codec.faiss")
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
  """The codec's factory string of a compact spec."""
  codec = spec[len(PREFIX):] if spec.startswith(PREFIX) else ""
  return codec or default_codec(dim)


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
  `scoring.token_scores` gathers code rows and calls `decode`)."""

  def __init__(self, codes: np.ndarray, codec):
    self.codes, self.codec, self.dim = codes, codec, codec.d

  def __len__(self) -> int:
    return len(self.codes)

  def decode(self, codes: np.ndarray) -> np.ndarray:
    """[n, D] float32 vectors of `codes` [n, C]."""
    return self.codec.sa_decode(np.ascontiguousarray(codes))


@dataclasses.dataclass
class CompactIndex:
  """A compact index folder, loaded: its arrays memory mapped, the kept tokens' passages and dump
  token ids (`positions`, None when every token is kept) derived."""

  directory: pathlib.Path
  manifest: dict
  codec: object  # the trained, empty faiss codec
  codes: np.ndarray  # [K, C] uint8, memory mapped
  char_spans: np.ndarray  # [K, 2], memory mapped
  token_passage: np.ndarray  # [K] int32, passage row of each kept token
  positions: np.ndarray | None  # [K] int64 dump token id of each kept token

  @classmethod
  def load(cls, directory: pathlib.Path, manifest: dict, num_passages: int) -> "CompactIndex":
    """The index in `directory` (its files' sizes and digests checked before: `check_index`);
    a DumpError when a part is unreadable or of other shapes than the manifest records."""
    try:
      codec = faiss.read_index(str(directory / "codec.faiss"))
    except RuntimeError as e:
      raise DumpError(f"{directory / 'codec.faiss'}: unreadable ({str(e).splitlines()[0]}); "
                      f"{REBUILD}") from None
    kept, tokens = manifest["num_tokens"], manifest["dump_tokens"]
    codes = _array(directory, "codes.npy", (kept, flat_codes(codec).code_size))
    spans = _array(directory, "char_spans.npy", (kept, 2))
    offsets = np.asarray(_array(directory, "passage_offsets.npy", (num_passages + 1,)))
    positions = None
    # (kept bits: an index-time filter's, or a dump-time one's: `dump_codes`)
    if manifest.get("filter_threshold") is not None or manifest.get("kept_bits"):
      bits = _array(directory, "kept.npy", ((tokens + 7) // 8,))
      positions = np.flatnonzero(np.unpackbits(bits, count=tokens))
      if len(positions) != kept:
        raise DumpError(f"{directory / 'kept.npy'}: {len(positions)} tokens kept, {kept} in the "
                        f"manifest; {REBUILD}")
    if offsets[-1] != tokens or (np.diff(offsets) < 0).any():
      raise DumpError(f"{directory / 'passage_offsets.npy'}: not the offsets of the dump's "
                      f"{tokens} tokens; {REBUILD}")
    ids = np.arange(kept) if positions is None else positions
    token_passage = (np.searchsorted(offsets, ids, "right") - 1).astype(np.int32)
    return cls(directory, manifest, codec, codes, spans, token_passage, positions)

  @property
  def vectors(self) -> CodedVectors:
    return CodedVectors(self.codes, self.codec)

  def searcher(self) -> "CodeSearch":
    """A faiss index of the codec whose codes are `codes.npy`'s memory, not a copy (labels:
    kept-token ranks)."""
    index = faiss.clone_index(self.codec)
    inner = flat_codes(index)
    # A view needs an owner argument: a null one (the memory map is `CodeSearch`'s to keep).
    empty = faiss.MaybeOwnedVectorUInt8()
    inner.codes = faiss.MaybeOwnedVectorUInt8.create_view(faiss.swig_ptr(self.codes),
                                                          self.codes.size, empty.owner)
    inner.ntotal = index.ntotal = len(self.codes)
    return CodeSearch(index, (self.codes, empty, inner))

  def token_ids(self, ranks: np.ndarray) -> np.ndarray:
    """The dump token ids of kept-token ranks (search results' `start_token` / `end_token`)."""
    ranks = np.asarray(ranks, np.int64)
    return ranks if self.positions is None else self.positions[ranks]


class CodeSearch:
  """A faiss index over codes it views but does not own, and what keeps them alive."""

  def __init__(self, index, keep: tuple):
    self.index, self._keep = index, keep

  @property
  def ntotal(self) -> int:
    return self.index.ntotal

  def search(self, queries: np.ndarray, k: int):
    """faiss's (scores, labels) [Q, k] of the codes' exhaustive search (labels: ranks)."""
    return self.index.search(queries, k)


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
