"""A compact index's codes scored from lookup tables (`CodedVectors.scores`: PQ, RQ and LSQ of
8-bit bytes) against the products of their decoded rows, and the codecs that fall back to
decoding."""
import faiss
import numpy as np
import pytest

from dpjax.index import compact, scoring
from dpjax.index.rescoring import TokenPassages

D = 32


def _codec(spec: str, data: np.ndarray):
  codec = faiss.index_factory(D, spec, faiss.METRIC_INNER_PRODUCT)
  codec.train(data)
  return codec


@pytest.fixture(scope="module")
def data() -> np.ndarray:
  return np.random.default_rng(0).standard_normal((3000, D)).astype(np.float32)


def _decoded_products(vectors: compact.CodedVectors, tokens, q_start, q_end):
  """token_scores with every row decoded (the path of codecs without tables)."""
  tables, vectors.tables = vectors.tables, None
  try:
    return scoring.token_scores(vectors, tokens, q_start, q_end)
  finally:
    vectors.tables = tables


@pytest.mark.parametrize("spec", ["OPQ4,PQ4", "PQ8", "RQ3x8", "OPQ4,LSQ3x8"])
@pytest.mark.parametrize("residual", [False, True])
def test_looked_up_scores_are_the_decoded_rows_products(data, spec, residual):
  codec = _codec(spec, data)
  codes = codec.sa_encode(data)
  offsets = np.arange(0, len(data) + 1, 100)  # 30 passages of 100 rows
  parts = {}
  if residual:  # each row coded as is; its passage's coded mean is added to it
    means_codec = _codec("SQ8", data)
    means = means_codec.sa_encode(data[offsets[:-1]])
    parts = {"passages": TokenPassages(offsets), "means": means, "means_codec": means_codec}
  vectors = compact.CodedVectors(codes, codec, **parts)
  assert vectors.tables is not None
  rng = np.random.default_rng(1)
  tokens = np.sort(rng.integers(0, len(data), (6, 200)), 1)
  q_start, q_end = rng.standard_normal((2, 6, D)).astype(np.float32)
  found = scoring.token_scores(vectors, tokens, q_start, q_end)
  want = _decoded_products(vectors, tokens, q_start, q_end)
  for got, expected in zip(found, want):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
  # A row's score is its own: the same bits whichever other rows are scored with it.
  alone = scoring.token_scores(vectors, tokens[:, ::7], q_start, q_end)
  for got, part in zip(found, alone):
    np.testing.assert_array_equal(got[:, ::7], part)


@pytest.mark.parametrize("spec", ["SQ8", "PQ4x4", "PCA16,PQ4", "RQ3x6", "PRQ2x2x8"])
def test_other_codecs_have_no_tables_and_are_decoded(data, spec):
  codec = _codec(spec, data)
  assert compact.lookup_tables(codec) is None
  vectors = compact.CodedVectors(codec.sa_encode(data), codec)
  rng = np.random.default_rng(2)
  tokens = np.sort(rng.integers(0, len(data), (3, 50)), 1)
  q_start, q_end = rng.standard_normal((2, 3, D)).astype(np.float32)
  decoded = codec.sa_decode(codec.sa_encode(data))
  found = scoring.token_scores(vectors, tokens, q_start, q_end)
  for got, q in zip(found, (q_start, q_end)):
    np.testing.assert_allclose(got, np.einsum("qnd,qd->qn", decoded[tokens], q), rtol=1e-5,
                               atol=1e-4)
