"""Phrase search on a toy index with hand-made vectors whose right answers are known."""
import re

import numpy as np
import pytest

from dpjax.data.squad import Passage
from dpjax.errors import ConfigError, DumpError
from dpjax.index import faiss_index
from dpjax.index.dump_reader import Dump
from dpjax.index.faiss_index import build_index, resolve_spec
from dpjax.index.manifest import write_manifest
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.scoring import half_to_float32
from dpjax.index.shards import write_shard
from dpjax.index.units import UNITS, sentence_bounds

DIM = 16
# Three documents, two passages each; every passage has two sentences.
PASSAGES = [
    Passage("a1", "Alpha", "Alpha is a red planet. It has two moons called Ares and Bia."),
    Passage("a2", "Alpha", "Alpha was found in 1911 by Lena Ortiz. Its year is long."),
    Passage("b1", "Beta", "Beta is a cold star. It burns blue gas near the core."),
    Passage("b2", "Beta", "Beta has no planets. Astronomers named it in 1802."),
    Passage("c1", "Gamma", "Gamma is a comet. Its tail is made of green dust."),
    Passage("c2", "Gamma", "Gamma returns every 76 years. Halley saw it first."),
]
# Question -> (passage row, answer text). Each answer gets its own start/end directions.
ANSWERS = [(1, "Lena Ortiz"), (2, "blue gas"), (3, "1802"), (4, "green dust"), (0, "Ares and Bia")]


def _toy_dump(directory, shards=2):
  rng = np.random.default_rng(0)
  words, passage_of = [], []
  for row, p in enumerate(PASSAGES):
    for m in re.finditer(r"\w+|[^\w\s]", p.text):
      words.append((m.start(), m.end()))
      passage_of.append(row)
  vectors = rng.normal(0, 0.05, (len(words), DIM)).astype(np.float32)
  queries = []
  for q, (row, answer) in enumerate(ANSWERS):
    s = PASSAGES[row].text.index(answer)
    e = s + len(answer)
    tokens = [t for t, (a, b) in enumerate(words) if passage_of[t] == row and a >= s and b <= e]
    vectors[tokens[0], 2 * q] = 1.0
    vectors[tokens[-1], 2 * q + 1] = 1.0
    queries.append((np.eye(DIM)[2 * q], np.eye(DIM)[2 * q + 1]))
  spans = np.array(words, np.int32)
  passage_of = np.array(passage_of, np.int32)
  # Split into shards of whole passages, as the dump writes them.
  cut = len(PASSAGES) // shards
  entries = []
  for i, rows in enumerate([range(0, cut), range(cut, len(PASSAGES))]):
    sel = np.isin(passage_of, list(rows))
    arrays = {"vectors": vectors[sel].astype(np.float16),
              "filter_logits": np.zeros((sel.sum(), 2), np.float16),
              "token_passage": (passage_of[sel] - rows.start).astype(np.int32),
              "char_spans": spans[sel]}
    entries.append(write_shard(directory, f"shard_{i:05d}", arrays,
                               [PASSAGES[r] for r in rows]))
  write_manifest(directory, {"complete": True, "fingerprint": "toy", "shards": entries,
                             "num_passages": len(PASSAGES), "num_tokens": len(words),
                             "dim": DIM, "settings": {}, "model": {}})
  q_start = np.array([a for a, _ in queries], np.float32)
  q_end = np.array([b for _, b in queries], np.float32)
  return q_start, q_end


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  directory = tmp_path_factory.mktemp("toy")
  q_start, q_end = _toy_dump(directory)
  build_index(directory, "Flat")
  build_index(directory, "IVF16,SQ8", nprobe=64)  # nlist clamped: 200 tokens allow 5
  return directory, q_start, q_end


@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])
@pytest.mark.parametrize("unit", UNITS)
def test_right_answer_at_rank_one(toy, index_name, unit):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  found = index.search(q_start, q_end, k=3, unit=unit)
  for q, (row, answer) in enumerate(ANSWERS):
    best, _ = found[q][0]
    assert best.text == answer
    assert best.passage == row
    assert len(found[q]) == 3  # k distinct units, fetching more phrases when needed
    keys = [key for _, key in found[q]]
    assert len(set(keys)) == len(keys)
    result = index.result(best, unit)
    assert result["title"] == PASSAGES[row].title and result["passage_id"] == PASSAGES[row].id
    if unit == "sentence":
      assert answer in result["sentence"] and result["sentence"].endswith(".")


def test_phrases_stay_in_their_passage_and_are_sorted(toy):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  for phrases in index.search_phrases(q_start, q_end, k=20, max_answer_length=4):
    scores = [p.score for p in phrases]
    assert scores == sorted(scores, reverse=True)
    assert len({(p.start_token, p.end_token) for p in phrases}) == len(phrases)
    for p in phrases:
      assert 0 <= p.end_token - p.start_token < 4
      assert index.dump.token_passage[p.start_token] == index.dump.token_passage[p.end_token]
      assert p.text == PASSAGES[p.passage].text[p.start_char:p.end_char]
  # The top score is the exact inner product from the stored vectors.
  top = index.search_phrases(q_start[:1], q_end[:1], k=1)[0][0]
  exact = (index.dump.vectors[top.start_token].astype(np.float32) @ q_start[0]
           + index.dump.vectors[top.end_token].astype(np.float32) @ q_end[0])
  assert top.score == pytest.approx(float(exact), rel=1e-5)


def test_clamping_and_errors(toy, tmp_path):
  spec, notes = resolve_spec("OPQ8,IVF4096,PQ8x8", 100, 1000)
  assert spec == "IVF2,PQ8x6" and len(notes) == 3  # OPQ trains 8-bit codebooks: 256 vectors
  assert resolve_spec("OPQ8,IVF4096,PQ8x8", 300, 1000)[0] == "OPQ8,IVF7,PQ8x8"
  # PQ<m> is 8 bits to faiss: clamped too (only PQ<m>x<bits> was); fast-scan (fs) is 4 bits.
  assert resolve_spec("IVF2,PQ6", 100, 1000) == ("IVF2,PQ6x6", [
      "PQ bits 8 clamped to 6: 100 training vectors"])
  assert resolve_spec("OPQ8_16,IVF2,PQ8", 100, 1000)[0] == "IVF2,PQ8x6"
  assert resolve_spec("IVF2,PQ8x4fs", 100, 1000)[0] == "IVF2,PQ8x4fs"
  directory, _, _ = toy
  with pytest.raises(DumpError, match="no index named 'nope'"):
    PhraseIndex(directory, "nope")
  with pytest.raises(DumpError, match="not a phrase dump"):
    Dump.load(tmp_path)
  (tmp_path / "manifest.json").write_text('{"complete": false}')
  with pytest.raises(DumpError, match="incomplete"):
    build_index(tmp_path, "Flat")


def test_specs_small_or_without_ids_build_and_search(toy, tmp_path, monkeypatch):
  """On 78 tokens: OPQ (its rotation trains 8-bit codebooks) and PQ<m> (8 bits) failed in
  faiss's training with a traceback; SQ8 / HNSW (no ids of their own) failed adding the vectors;
  a failed write of index.faiss (a full disk: faiss raises RuntimeError) was a traceback."""
  directory, q_start, q_end = toy
  exact = PhraseIndex(directory, "Flat").search_phrases(q_start, q_end, k=1)
  for spec in ("OPQ4,IVF2,PQ4", "IVF2,PQ4", "SQ8", "HNSW8"):
    name = build_index(directory, spec).name
    found = PhraseIndex(directory, name).search_phrases(q_start, q_end, k=1)
    assert [f[0].text for f in found] == [f[0].text for f in exact], spec
  # What is not clamped and cannot train (residual quantizer codebooks of 256 on 78 tokens): a
  # one-line ConfigError with faiss's message.
  with pytest.raises(ConfigError, match=r"'IVF2,RQ2x8' cannot be trained on 78 vectors \(Error "
                                        r"in .*Clustering::train"):
    build_index(directory, "IVF2,RQ2x8")
  def full(index, path):
    raise RuntimeError("Error in faiss::write_index: write error in x: 1 != 2 (No space left)")
  monkeypatch.setattr(faiss_index.faiss, "write_index", full)
  with pytest.raises(DumpError, match=r"indexes/Flat_again\.tmp/index\.faiss: could not write "
                                      r"the index \(Error in faiss::write_index: .*No space"):
    build_index(directory, "Flat", name="Flat_again")
  assert not list((directory / "indexes").glob("*.tmp"))


@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])
def test_rescoring_in_chunks_gives_the_same_results(toy, index_name, monkeypatch):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  whole = index.search(q_start, q_end, k=4, unit="passage")
  monkeypatch.setattr("dpjax.index.scoring.RESCORE_ELEMENTS", 1)  # one question per chunk
  chunked = index.search(q_start, q_end, k=4, unit="passage")
  assert [[(p.start_token, p.end_token) for p, _ in u] for u in whole] == \
      [[(p.start_token, p.end_token) for p, _ in u] for u in chunked]


def _reference_phrases(index, q_start, q_end, starts, ends, k, max_len):
  """Rescoring spelled out: each start hit with its best end (and each end hit with its best
  start) within max_len tokens of its passage, then the k best distinct spans."""
  vectors = index.dump.vectors.astype(np.float32)
  found = []
  for q in range(len(q_start)):
    candidates = []
    for anchor, forward in [(s, True) for s in starts[q]] + [(e, False) for e in ends[q]]:
      if anchor < 0:
        continue
      passage = index.dump.token_passage[anchor]
      best = None
      for o in range(max_len):
        partner = anchor + o if forward else anchor - o
        if not index.passage_start[passage] <= partner < index.passage_end[passage]:
          continue
        s, e = (anchor, partner) if forward else (partner, anchor)
        score = vectors[s] @ q_start[q] + vectors[e] @ q_end[q]
        if best is None or score > best[0]:
          best = (score, s, e)
      candidates.append(best)
    spans = []
    for score, s, e in sorted(candidates, key=lambda c: -c[0]):
      if (s, e) not in [x[:2] for x in spans]:
        spans.append((s, e, score))
    found.append(spans[:k])
  return found


@pytest.mark.parametrize("max_len", [1, 3, 10])
@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])  # float32 storage, float16 dump
def test_rescoring_equals_the_spelled_out_rule(toy, index_name, max_len):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  rng = np.random.default_rng(max_len)
  q_start = q_start + rng.normal(0, 0.3, q_start.shape).astype(np.float32)  # many near spans
  q_end = q_end + rng.normal(0, 0.3, q_end.shape).astype(np.float32)
  starts, ends = index.hits(q_start, q_end, 12)
  starts[0, -3:] = -1  # fewer hits than asked
  got = index.search_phrases(q_start, q_end, 8, max_answer_length=max_len, hits=(starts, ends),
                             top_tokens=12)
  want = _reference_phrases(index, q_start, q_end, starts, ends, 8, max_len)
  assert [[(p.start_token, p.end_token) for p in ps] for ps in got] == \
      [[(s, e) for s, e, _ in ps] for ps in want]
  np.testing.assert_allclose([p.score for ps in got for p in ps],
                             [x for ps in want for _, _, x in ps], rtol=1e-5, atol=1e-6)
  # With every token a hit, the best phrase is the best span of the whole corpus.
  n = index.num_vectors
  every = np.broadcast_to(np.arange(n), (len(q_start), n))
  top = index.search_phrases(q_start, q_end, 1, max_answer_length=max_len, hits=(every, every),
                             top_tokens=n)
  vectors = index.dump.vectors.astype(np.float32)
  for q, (phrase,) in enumerate(top):
    best = max((vectors[s] @ q_start[q] + vectors[e] @ q_end[q], s, e) for s in range(n)
               for e in range(s, min(s + max_len, index.passage_end[index.dump.token_passage[s]])))
    assert (phrase.start_token, phrase.end_token) == best[1:]


def test_sentences_end_at_terminal_punctuation_not_at_abbreviations():
  text = ('Dr. Smith met J. R. R. Tolkien in the U.S. in 1950. They talked, e.g. about maps! '
          'Did they? yes. "Quite so." He left. 3 went.')
  bounds = sentence_bounds(text)
  assert [text[a:b] for a, b in zip(bounds, bounds[1:])] == [
      "Dr. Smith met J. R. R. Tolkien in the U.S. in 1950. ", "They talked, e.g. about maps! ",
      "Did they? yes. ", '"Quite so." ', "He left. ", "3 went."]
  assert sentence_bounds("") == [0, 0] and sentence_bounds("No end") == [0, 6]


def test_float16_rows_convert_exactly():
  every = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(-1, 64)  # all bit patterns
  out = half_to_float32(every)
  want = every.astype(np.float32)
  assert out.dtype == np.float32 and out.shape == every.shape
  finite = np.isfinite(want)
  assert np.array_equal(out.view(np.uint32)[finite], want.view(np.uint32)[finite])  # subnormals,
  assert np.array_equal(np.isnan(out), np.isnan(want))  # zeros and signs bit for bit
  assert np.array_equal(out[np.isinf(want)], want[np.isinf(want)])
  assert half_to_float32(every[:0]).shape == (0, 64)
  strided = every[:, ::2]  # not contiguous
  assert np.array_equal(half_to_float32(strided), strided.astype(np.float32), equal_nan=True)


def test_float16_scores_equal_float32_rows(monkeypatch):
  """Token scores from float16 rows, gathered and converted a chunk of questions at a time (a
  question larger than a chunk alone; one-row and empty questions), are the per-question
  products of the same rows in float32, bit for bit."""
  from dpjax.index import scoring
  rng = np.random.default_rng(0)
  half = rng.standard_normal((50, 16)).astype(np.float16)
  bounds = np.concatenate([[0], np.cumsum([3, 1, 0, 9, 20, 1, 2, 5])])
  token = rng.integers(0, 50, bounds[-1])
  queries = rng.standard_normal((8, 16, 2)).astype(np.float32)
  want = np.full((bounds[-1], 2), np.nan, np.float32)
  scoring._score_questions(half.astype(np.float32), token, queries, bounds, want, 0, 8)
  widths = []
  convert = scoring.half_to_float32
  monkeypatch.setattr(scoring, "half_to_float32", lambda h: widths.append(len(h)) or convert(h))
  monkeypatch.setattr(scoring, "CONVERT_ROWS", 8)
  got = np.full_like(want, np.nan)
  scoring._score_questions(half, token, queries, bounds, got, 0, 8)
  assert np.array_equal(got, want) and not np.isnan(want).any()
  # one shape: questions 0-2 (4 rows), 3 (9: 8 + 1), 4 (20: 8 + 8 + 4), 5-6 (3), 7 (5)
  assert widths == [8] * 8
  part = np.full_like(want, np.nan)
  scoring._score_questions(half, token, queries, bounds, part, 2, 6)
  assert np.array_equal(part[bounds[2]:bounds[6]], want[bounds[2]:bounds[6]])
  assert np.isnan(part[:bounds[2]]).all() and np.isnan(part[bounds[6]:]).all()


@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])
def test_token_scores_in_threads_equal_one_thread(toy, index_name, monkeypatch):
  """The rescoring's token scores split over threads (4 here, each a contiguous group of
  questions) are one thread's, bit for bit: from the Flat index's float32 storage and from the
  dump's float16 rows (IVF); and so are the searches' phrases. Without threadpoolctl one thread
  scores them."""
  import threading
  import faiss
  from dpjax.index import scoring
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  rng = np.random.default_rng(5)
  queries = [rng.normal(size=(24, DIM)).astype(np.float32) for _ in range(2)]
  tokens = rng.integers(0, len(index.dump.vectors), (24, 30, 4))

  def run(threads):
    monkeypatch.setattr(scoring, "_RESCORE_THREADS", threads)
    groups.clear()
    scores = index.rescorer.token_scores(tokens, *queries)
    parts = sorted(groups)
    return scores, parts, index.search(*queries, k=3, unit="phrase")

  groups, idents = [], set()
  score_questions = scoring._score_questions

  def spy(*args):
    groups.append(args[-2:])
    idents.add(threading.get_ident())
    return score_questions(*args)
  monkeypatch.setattr(scoring, "_score_questions", spy)
  monkeypatch.setattr(scoring, "_RESCORE_ROWS_PER_THREAD", 1)
  omp = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(4)
  try:
    (one, one_parts, found_one), (four, parts, found_four) = run(1), run(16)
  finally:
    faiss.omp_set_num_threads(omp)
  for a, b in zip(one, four):
    assert np.array_equal(a, b)
  assert [[(p.start_token, p.end_token, p.score) for p, _ in u] for u in found_one] == \
      [[(p.start_token, p.end_token, p.score) for p, _ in u] for u in found_four]
  # 4 groups, scored in the pool's threads (a worker done with one group may take another)
  assert one_parts == [(0, 24)] and len(parts) == 4 and idents - {threading.get_ident()}
  assert parts[0][0] == 0 and parts[-1][1] == 24 and all(
      a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous groups, every question once
  monkeypatch.setattr(scoring, "_BLAS", False)  # threadpoolctl missing
  assert scoring._scoring_threads(10 ** 6) == 1


def test_blas_held_at_one_thread_until_the_last_search_leaves():
  """Searches in several threads (here two, one inside the other's span) hold BLAS at one
  thread until the last leaves, which restores BLAS's own count."""
  from dpjax.index import scoring
  controller = scoring._blas_controller()
  if controller is None:
    pytest.skip("threadpoolctl is not installed")
  blas = lambda: {d["num_threads"] for d in controller.info() if d["user_api"] == "blas"}
  with controller.limit(limits=2, user_api="blas"):
    first, second = scoring._one_blas_thread(), scoring._one_blas_thread()
    first.__enter__()
    second.__enter__()
    assert blas() == {1}
    first.__exit__(None, None, None)
    assert blas() == {1}
    second.__exit__(None, None, None)
    assert blas() == {2}


def _units_one_search_per_round(index, q_start, q_end, k, unit):
  """The unit search as a fresh index search of every round (what the cached hits must equal)."""
  fetch, max_fetch = 2 * k, min(20 * k, 2 * index.num_vectors)  # a start and an end per token
  units, pending = [None] * len(q_start), list(range(len(q_start)))
  while pending:
    phrases = index.search_phrases(q_start[pending], q_end[pending], fetch, top_tokens=fetch)
    short = []
    for q, found in zip(pending, phrases):
      best = {}
      for phrase in found:
        best.setdefault(index.unit_key(phrase, unit), phrase)
      units[q] = [(p, key) for key, p in list(best.items())[:k]]
      if len(units[q]) < k and fetch < max_fetch:
        short.append(q)
    pending, fetch = short, min(fetch * 4, max_fetch)
  return units


@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])
@pytest.mark.parametrize("unit,k", [("passage", 4), ("passage", 5), ("document", 3),
                                    ("document", 4)])
def test_unit_search_searches_the_index_at_most_twice(toy, index_name, unit, k):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  expected = _units_one_search_per_round(index, q_start, q_end, k, unit)
  calls = []
  hits = index._hits
  index._hits = lambda qs, qe, n: calls.append(n) or hits(qs, qe, n)
  found = index.search(q_start, q_end, k=k, unit=unit)
  assert [[(p.start_token, p.end_token, p.score, key) for p, key in u] for u in found] == \
      [[(p.start_token, p.end_token, p.score, key) for p, key in u] for u in expected]
  assert len(calls) <= 2  # one faiss search (starts and ends together) for the first round,
  # then one wide search (the document cases need three rounds: a search per round makes 3)


@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])
def test_searches_sharing_one_index_search(toy, index_name):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  requests = [(3, "phrase"), (4, "passage"), (4, "document"), (5, "sentence")]
  alone = [index.search(q_start, q_end, k, unit) for k, unit in requests]
  width = max(index.fetch_bounds(k)[unit != "phrase"] for k, unit in requests)
  hits = index.hits(q_start, q_end, width)
  calls = []
  index._hits = lambda qs, qe, n: calls.append(n) or PhraseIndex._hits(index, qs, qe, n)
  shared = [index.search(q_start, q_end, k, unit, hits=hits) for k, unit in requests]
  assert calls == []  # every round of every search served by the shared hits
  key = lambda found: [[(p.start_token, p.end_token, p.score, u) for p, u in f] for f in found]
  if index_name == "Flat":
    assert list(map(key, shared)) == list(map(key, alone))
  else:  # the top-f of a wider search equal a top-f search up to ties of the approximate
    # scores, and SQ8 codes of the toy's near-zero components tie often: the answers still agree
    assert [[f[0][0].text for f in found] for found in shared] == \
        [[f[0][0].text for f in found] for found in alone]
  # Hits narrower than a round needs: that round searches the index itself.
  narrow = index.search(q_start, q_end, 4, "document", hits=index.hits(q_start, q_end, 2))
  assert calls
  if index_name == "Flat":
    assert key(narrow) == key(alone[2])


def test_tuned_exact_search_returns_what_faiss_defaults_return():
  import faiss

  from dpjax.index.faiss_index import tune_exact_search
  rng = np.random.default_rng(0)
  vectors = rng.standard_normal((70_000, 16)).astype(np.float32)  # > one 65,536-vector block
  queries = rng.standard_normal((64, 16)).astype(np.float32)
  index = faiss.IndexFlatIP(16)
  index.add(vectors)
  tuned = index.search(queries, 20)
  cvar = faiss.cvar
  names = ("distance_compute_blas_threshold", "distance_compute_blas_query_bs",
           "distance_compute_blas_database_bs")
  assert [getattr(cvar, n) for n in names] == [20, 1024, 65536]  # set on import
  try:
    for name, default in zip(names, (128_000, 4096, 1024)):  # faiss 1.15's defaults
      setattr(cvar, name, default)
    plain = index.search(queries, 20)
  finally:
    tune_exact_search()
  np.testing.assert_array_equal(tuned[1], plain[1])
  np.testing.assert_allclose(tuned[0], plain[0], rtol=1e-5)


@pytest.mark.parametrize("num,k,block", [(5, 8, None), (1000, 10, None), (3001, 40, 64),
                                         (20_000, 300, 512)])
def test_device_flat_returns_what_faiss_returns(num, k, block, monkeypatch):
  """The JAX exact search over 8 devices (rows padded to whole blocks, several blocks per device
  where `block` is small) against faiss's IndexFlatIP: the same scores rank by rank, labels
  mapped through `ids`, -1 past the last vector; labels equal except between near-ties."""
  import faiss

  from dpjax.index import device_search
  if block:
    monkeypatch.setattr(device_search, "BLOCK_ROWS", block)
  rng = np.random.default_rng(num)
  vectors = rng.standard_normal((num, DIM)).astype(np.float16)
  queries = rng.standard_normal((300, DIM)).astype(np.float32)  # > one 256-query chunk
  ids = rng.permutation(10 * num)[:num]
  reference = faiss.IndexIDMap(faiss.IndexFlatIP(DIM))
  reference.add_with_ids(vectors.astype(np.float32), ids)
  want_scores, want = reference.search(queries, k)
  index = device_search.DeviceFlat(vectors, ids)
  assert index.mesh.size == 8 and (block is None or index.block == block)
  scores, got = index.search(queries, k)
  found = want >= 0
  assert (got >= 0).tolist() == found.tolist()
  np.testing.assert_allclose(scores[found], want_scores[found], rtol=1e-5, atol=1e-5)
  assert np.isneginf(scores[~found]).all()
  # Each label's score is its vector's inner product (not a neighbour's).
  rows = {int(i): r for r, i in enumerate(ids)}
  exact = np.array([[vectors[rows[int(i)]].astype(np.float64) @ q if i >= 0 else -np.inf
                     for i in line] for q, line in zip(queries, got)])
  np.testing.assert_allclose(scores[found], exact[found], rtol=1e-5, atol=1e-5)
  gap = np.diff(want_scores, axis=1, prepend=np.inf, append=-np.inf)
  clear = found & (np.abs(gap[:, :-1]) > 1e-4) & (np.abs(gap[:, 1:]) > 1e-4)
  np.testing.assert_array_equal(got[clear], want[clear])


def test_device_search_choice():
  from dpjax.index.device_search import DeviceFlat, use_device_search
  assert use_device_search("auto", 1 << 20) is False  # a CPU: faiss
  assert use_device_search("jax", 1 << 20) and not use_device_search("faiss", 1 << 20)
  with pytest.raises(ValueError, match="search_device must be one of"):
    use_device_search("gpu", 1)
  with pytest.raises(ValueError, match=r"\[N > 0, D\]"):
    DeviceFlat(np.zeros((0, DIM), np.float16))
  with pytest.raises(ValueError, match="queries must be"):
    DeviceFlat(np.ones((4, DIM), np.float16)).search(np.ones((2, DIM + 1), np.float32), 2)


def test_phrase_index_on_the_devices_answers_as_faiss(toy):
  directory, q_start, q_end = toy
  key = lambda found: [[(p.start_token, p.end_token, p.score, u) for p, u in f] for f in found]
  host = PhraseIndex(directory, "Flat", search_device="faiss")
  device = PhraseIndex(directory, "Flat", search_device="jax")
  assert type(device.index).__name__ == "DeviceFlat"
  for k, unit in [(3, "phrase"), (4, "passage"), (4, "document"), (5, "sentence")]:
    assert key(device.search(q_start, q_end, k, unit)) == key(host.search(q_start, q_end, k, unit))
  # An exact index over a subcorpus: labels are its tokens' ids in the whole dump.
  dump = Dump.load(directory)
  sub = {d: PhraseIndex.over_passages(dump, [1, 2, 4], search_device=d) for d in ("faiss", "jax")}
  found = {d: sub[d].search(q_start, q_end, 3, "passage") for d in sub}
  assert key(found["jax"]) == key(found["faiss"])
  assert {p.passage for f in found["jax"] for p, _ in f} <= {1, 2, 4}
  # IVF stays with faiss whatever the choice.
  assert type(PhraseIndex(directory, "IVF16_SQ8", search_device="jax").index).__name__ != \
      "DeviceFlat"


def test_device_flat_warm_compiles_every_width_once():
  from dpjax.index import device_search
  index = device_search.DeviceFlat(np.ones((100, DIM), np.float16))
  device_search._top_k_fn.cache_clear()
  assert index.warm(100) == 4  # k buckets 16, 32, 64, 128
  assert device_search._top_k_fn.cache_info().currsize == 4
  index.search(np.ones((3, DIM), np.float32), 50)  # served by the compiled 64-wide program
  assert device_search._top_k_fn.cache_info().currsize == 4


def test_filtered_flat_on_the_devices_answers_as_faiss(tmp_path):
  """A Flat index of the tokens a filter threshold keeps: the device search holds the same
  tokens (labels are their dump ids); an index older than the dump's filter logits keeps faiss."""
  q_start, q_end = _toy_dump(tmp_path)
  rng = np.random.default_rng(1)
  for shard in sorted(tmp_path.glob("shard_*")):
    logits = np.load(shard / "filter_logits.npy")
    np.save(shard / "filter_logits.npy", rng.normal(0, 1, logits.shape).astype(np.float16))
  build_index(tmp_path, "Flat", name="Flat", filter_threshold=0.0)
  key = lambda found: [[(p.start_token, p.end_token, p.score, u) for p, u in f] for f in found]
  host = PhraseIndex(tmp_path, "Flat", search_device="faiss")
  device = PhraseIndex(tmp_path, "Flat", search_device="jax")
  assert type(device.index).__name__ == "DeviceFlat"
  assert 0 < device.index.ntotal == host.index.ntotal < len(device.dump.vectors)
  for k, unit in [(3, "phrase"), (4, "passage")]:
    assert key(device.search(q_start, q_end, k, unit)) == key(host.search(q_start, q_end, k, unit))
  for shard in sorted(tmp_path.glob("shard_*")):  # logits rewritten after the index was built
    np.save(shard / "filter_logits.npy", np.ones_like(np.load(shard / "filter_logits.npy")))
  assert type(PhraseIndex(tmp_path, "Flat", search_device="jax").index).__name__ != "DeviceFlat"


@pytest.mark.parametrize("index_name", ["Flat", "IVF16_SQ8"])
def test_searches_sharing_one_index_search_rescore_each_hit_once(toy, index_name):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, index_name)
  requests = [(3, "phrase"), (4, "passage"), (4, "document"), (5, "sentence")]
  width = max(index.fetch_bounds(k)[unit != "phrase"] for k, unit in requests)
  alone = [index.search(q_start, q_end, k, unit, hits=index.hits(q_start, q_end, width))
           for k, unit in requests]  # a fresh rescoring per search
  rescored = {}  # question -> start and end hits rescored
  rescore = index.rescorer.rescore

  def counted(qs, qe, starts, ends, max_answer_length):
    for q, s, e in zip(qs, starts, ends):
      rescored[q.tobytes()] = rescored.get(q.tobytes(), 0) + len(s) + len(e)
    return rescore(qs, qe, starts, ends, max_answer_length)

  index.rescorer.rescore = counted
  hits = index.hits(q_start, q_end, width)
  # a copy with other options shares the index's rescoring, and so the hits' rescored spans
  unmerged = index.with_options(merge_spans=False)
  assert unmerged.rescorer is index.rescorer
  shared = [(unmerged if unit == "passage" else index).search(q_start, q_end, k, unit, hits=hits)
            for k, unit in requests]
  key = lambda found: [[(p.start_token, p.end_token, p.score, u) for p, u in f] for f in found]
  assert list(map(key, shared)) == list(map(key, alone))
  # Each hit rescored at most once over all rounds and searches (without the rescoring the hits
  # keep, every round rescores the first hits again: 348 here against at most 156).
  assert max(rescored.values()) <= 2 * hits[0].shape[1]
  assert sorted(rescored) == sorted(q.tobytes() for q in q_start)


def test_the_searcher_keeps_its_old_name():
  """`dpjax.DensePhrases`, the searcher's name before `PhraseSearcher` (the model class has it
  too), still names the searcher."""
  import dpjax
  from dpjax.index import search
  assert dpjax.DensePhrases is dpjax.PhraseSearcher is search.PhraseSearcher


def test_plain_hits_share_their_rescoring_across_rounds(toy):
  """Hits given as a plain (starts, ends) pair are wrapped once: a unit search's rounds rescore
  each hit at most once (wrapped with the index itself, every round started over)."""
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  width = index.fetch_bounds(4)[1]
  found = index.hits(q_start, q_end, width)
  columns, rescore = [], index.rescorer.rescore
  index.rescorer.rescore = lambda qs, qe, s, e, n: columns.append(s.shape[1]) or rescore(
      qs, qe, s, e, n)
  shared = index.search(q_start, q_end, 4, "document", hits=found)
  shared_columns, columns[:] = sum(columns), []
  plain = index.search(q_start, q_end, 4, "document", hits=(found[0], found[1]))
  key = lambda units: [[(p.start_token, p.end_token, p.score) for p, _ in u] for u in units]
  assert key(plain) == key(shared) and sum(columns) == shared_columns <= width
