"""Passage-residual and question-weighted compact indexes (`compact:[qw+]pr:<codec>`,
`dpjax.index.residual`) on the tiny trained workdir's dump: exact codes answer as the Flat
index, the passage-first search scores what the codes decode to, and what cannot be built is
refused."""
import shutil

import faiss
import numpy as np
import pytest

from conftest import phrase_questions

from dpjax.errors import ConfigError, DumpError
from dpjax.index import residual
from dpjax.index.compact import CodeSearch
from dpjax.index.faiss_index import build_index
from dpjax.index.phrase_index import PhraseIndex

QUESTIONS = 61


@pytest.fixture(scope="module")
def dump(tiny_workdir, tmp_path_factory):
  """A copy of the tiny workdir's dump with residual compact indexes (every passage visited)."""
  directory = tmp_path_factory.mktemp("residual") / "dump"
  shutil.copytree(tiny_workdir / "dump", directory)
  weighting = _weighting(PhraseIndex(directory, "Flat"))
  for spec in ("compact:pr:Flat", "compact:qw+pr:Flat", "compact:qw:Flat", "compact:pr:PQ6",
               "compact:qw+pr:PQ5x4", "compact:qw+pr:RQ4x8"):
    build_index(directory, spec, nprobe=10_000, weighting=weighting)
  return directory


def _weighting(flat: PhraseIndex) -> residual.Weighting:
  """A question weighting of seeded questions made of the dump's own vectors."""
  return residual.Weighting.of_questions(np.concatenate(_questions(flat, 13)))


def _questions(flat: PhraseIndex, seed: int = 7):
  return phrase_questions(flat.dump.vectors, QUESTIONS, seed)


def _top(index: PhraseIndex, q_start, q_end, k: int = 5):
  return [[(p.text, p.passage, p.score) for p, _ in units]
          for units in index.search(q_start, q_end, k)]


@pytest.mark.parametrize("name", ["compact_pr_Flat", "compact_qw_pr_Flat", "compact_qw_Flat"])
def test_exact_residual_codes_answer_as_the_flat_index(dump, name):
  flat, compact = PhraseIndex(dump, "Flat"), PhraseIndex(dump, name)
  q_start, q_end = _questions(flat)
  ours, theirs = _top(compact, q_start, q_end), _top(flat, q_start, q_end)
  # mean + residual (float32), weighted and mapped back: the Flat scores up to rounding
  assert [[a[:2] for a in found] for found in ours] == [[a[:2] for a in found] for found in theirs]
  np.testing.assert_allclose([[a[2] for a in found] for found in ours],
                             [[a[2] for a in found] for found in theirs], rtol=1e-4, atol=1e-3)
  # QSFT's candidates: the vectors decoded back into the dump's space
  ranks = np.arange(0, compact.num_vectors, 7)
  np.testing.assert_allclose(compact.compact.vectors.original(ranks),
                             np.asarray(flat.dump.vectors[ranks], np.float32), atol=2e-3)


def test_a_residual_index_records_its_parts(dump):
  manifest = PhraseIndex(dump, "compact_qw_pr_PQ5x4").manifest
  assert manifest["residual"] and manifest["weighted"] and manifest["nprobe"] == 10_000
  assert manifest["resolved_spec"] == "compact:qw+pr:PQ5x4"
  assert manifest["means_codec"] == "SQfp16"  # (a corpus of fewer passages than PQ trains on)
  for part in (residual.MEANS, residual.MEANS_CODEC, residual.WEIGHTING):
    assert manifest["parts"][part]["bytes"] > 0 and part in manifest["files"]
  assert not PhraseIndex(dump, "compact_pr_PQ6").manifest["weighted"]


def test_pq_residual_codes_agree_with_the_flat_index(dump):
  flat, compact = PhraseIndex(dump, "Flat"), PhraseIndex(dump, "compact:pr:PQ6")
  q_start, q_end = _questions(flat)
  agree = np.mean([a[0][:2] == b[0][:2] for a, b in zip(_top(compact, q_start, q_end),
                                                       _top(flat, q_start, q_end))])
  assert agree >= 0.6, agree  # (the bound of plain PQ6 codes, test_compact_index)


@pytest.mark.parametrize("name", ["compact_pr_PQ6", "compact_qw_pr_PQ5x4", "compact_qw_pr_RQ4x8"])
def test_the_passage_first_search_scores_what_the_codes_decode_to(dump, name):
  """Its scores (lookup tables for 8-bit PQ and RQ, decoding for other codes) are the queries'
  products with the decoded tokens of their visited passages, and its labels the best of them."""
  index = PhraseIndex(dump, name)
  q_start, _ = _questions(PhraseIndex(dump, "Flat"))
  scores, labels = index.index.search(q_start, 9)
  ranks = np.arange(index.num_vectors)
  decoded = index.compact.vectors.decode(index.compact.codes[ranks], ranks)
  exact = index.compact.vectors.queries(q_start) @ decoded.T  # [Q, K]: every passage visited
  np.testing.assert_allclose(scores, np.take_along_axis(exact, labels, 1), rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(scores[:, 0], exact.max(1), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("spec", ["OPQ4,PQ4", "RQ4x8", "LSQ4x8"])
def test_lookup_tables_score_as_decoding(spec):
  """8-bit PQ's sub-vector tables and an additive quantizer's (RQ, LSQ: full-width codebooks
  summed) give the scores decoding gives."""
  rng = np.random.default_rng(5)
  codec = faiss.index_factory(16, spec, faiss.METRIC_INNER_PRODUCT)
  codec.train(rng.normal(size=(3000, 16)).astype(np.float32))
  codes = codec.sa_encode(rng.normal(size=(211, 16)).astype(np.float32))
  means = np.zeros((5, 16), np.float16)
  offsets = np.array([0, 40, 40, 97, 150, 211])  # (one passage without tokens)
  means_codec = faiss.index_factory(16, "SQfp16", faiss.METRIC_INNER_PRODUCT)
  means_search = CodeSearch.over(means_codec, means_codec.sa_encode(
      rng.normal(size=(5, 16)).astype(np.float32)))
  queries = rng.normal(size=(7, 16)).astype(np.float32)
  tables = residual.PassageFirstSearch(means_search, codec, codes, offsets, None, 3)
  decoding = residual.PassageFirstSearch(means_search, codec, codes, offsets, None, 3)
  decoding._tables = None
  assert tables._tables is not None
  (s1, l1), (s2, l2) = tables.search(queries, 300), decoding.search(queries, 300)
  np.testing.assert_array_equal(l1 >= 0, l2 >= 0)
  np.testing.assert_allclose(s1, s2, rtol=1e-4, atol=1e-4)
  # each query's labels are the tokens of its 3 best passages by mean, no other
  _, best = means_search.search(queries, 3)
  for q in range(len(queries)):
    passages = np.searchsorted(offsets, l1[q][l1[q] >= 0], "right") - 1
    assert set(passages) == set(best[q]) - {1}
    assert (l1[q] >= 0).sum() == sum(offsets[p + 1] - offsets[p] for p in best[q])
  del means


def test_codecs_without_byte_tables_are_scored_by_decoding():
  """Codes whose bytes are not one full-width table row each (RQ of 6-bit stages, product RQ and
  LSQ over sub-vectors, SQ) get no tables."""
  for spec in ("RQ4x6", "PRQ2x2x8", "PLSQ2x2x8", "SQ8"):
    codec = faiss.index_factory(16, spec, faiss.METRIC_INNER_PRODUCT)
    codec.train(np.random.default_rng(0).normal(size=(3000, 16)).astype(np.float32))
    assert residual._pq_tables(codec) is None, spec


def test_fewer_passages_visited_find_tokens_of_the_best_passages_only(dump):
  index = PhraseIndex(dump, "compact_pr_PQ6", nprobe=1)
  q_start, _ = _questions(PhraseIndex(dump, "Flat"))
  _, labels = index.index.search(q_start, 5)
  _, best = index.index.means.search(q_start, 1)
  passages = index.compact.token_passage[np.maximum(labels, 0)]
  assert ((passages == best) | (labels < 0)).all()


@pytest.mark.parametrize("spec, kwargs, error, message", [
    ("compact:qw+pr:PQ6", {}, ConfigError, "question weighting needs the model's question"),
    ("compact:xx:PQ6", {}, ConfigError, "modifiers before ':' are 'qw', 'pr' or 'qw\\+pr'"),
    ("compact:pr+pr:PQ6", {}, ConfigError, "modifiers before ':'"),
    ("compact:pr:IVF4,PQ6", {}, ConfigError, "a codec of flat codes"),
])
def test_a_residual_index_that_cannot_be_built_is_refused(dump, tmp_path, spec, kwargs, error,
                                                          message):
  copy = tmp_path / "dump"
  shutil.copytree(dump, copy)
  before = sorted(p.name for p in (copy / "indexes").iterdir())
  with pytest.raises(error, match=message) as e:
    build_index(copy, spec, **kwargs)
  assert "\n" not in str(e.value)
  assert sorted(p.name for p in (copy / "indexes").iterdir()) == before


def test_damaged_means_are_refused(dump, tmp_path):
  copy = tmp_path / "dump"
  shutil.copytree(dump, copy)
  means = copy / "indexes/compact_pr_PQ6" / residual.MEANS
  data = means.read_bytes()
  means.write_bytes(data[:128] + bytes(len(data) - 128))
  with pytest.raises(DumpError, match=f"{residual.MEANS}: its bytes differ"):
    PhraseIndex(copy, "compact:pr:PQ6", verify=True)
  means.write_bytes(data[:-4])
  with pytest.raises(DumpError, match=f"{residual.MEANS}: .* bytes, .* when it was written"):
    PhraseIndex(copy, "compact:pr:PQ6")


def test_run_index_weights_by_the_models_training_questions(tiny_workdir, tmp_path):
  """`run.py index` encodes the training questions for a question-weighted spec, and `run.py
  eval` searches the index it built."""
  import run
  from dpjax.main import open_workdir
  from dpjax.main.index import question_weighting
  workdir = tmp_path / "demo"
  shutil.copytree(tiny_workdir, workdir)
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  spec = ["--set", "index.specs=['compact:qw+pr:PQ6']"]
  assert run.main(["index"] + base + spec) == 0
  index = PhraseIndex(workdir / "dump", "compact:qw+pr:PQ6", verify=True)
  settings, opened, _, _ = open_workdir("experiments/demo.py:tiny", workdir)
  expected = question_weighting(settings, opened)
  np.testing.assert_allclose(index.compact.weighting.root, expected.root, rtol=1e-5, atol=1e-6)
  assert run.main(["eval"] + base + ["--set", "index.search_index=compact_qw_pr_PQ6"]) == 0


def test_the_scale_studys_mapped_search_matches_one_in_memory(dump):
  from conftest import load_script
  scale = load_script("experiments/benchmarks/scale.py")
  index = PhraseIndex(dump, "compact_pr_PQ6", nprobe=3)
  q_start, q_end = _questions(PhraseIndex(dump, "Flat"))
  found = scale.mapped_matches_loaded(index, q_start, q_end)
  assert found["identical"] and found["questions"] == QUESTIONS


def test_weighting_without_training_questions_is_refused_in_one_line(tiny_workdir, monkeypatch):
  from dpjax.main import index as index_mode
  from dpjax.main import open_workdir

  def no_questions(*args):
    raise ConfigError("index.sparse: no training questions to choose the weight on")
  monkeypatch.setattr(index_mode, "tune_questions", no_questions)
  settings, workdir, _, _ = open_workdir("experiments/demo.py:tiny", tiny_workdir)
  with pytest.raises(ConfigError, match=r"\(qw:\) needs training questions .* compact:pr:") as e:
    index_mode.question_weighting(settings, workdir)
  assert "\n" not in str(e.value)
