"""Phrase search on a toy index with hand-made vectors whose right answers are known."""
import re

import numpy as np
import pytest

from dpjax.corpus import CorpusPassage
from dpjax.index.dump import Dump, DumpError, write_manifest, write_shard
from dpjax.index.faiss_index import build_index, resolve_spec
from dpjax.search import UNITS, PhraseIndex

DIM = 16
# Three documents, two passages each; every passage has two sentences.
PASSAGES = [
    CorpusPassage("a1", "Alpha", "Alpha is a red planet. It has two moons called Ares and Bia."),
    CorpusPassage("a2", "Alpha", "Alpha was found in 1911 by Lena Ortiz. Its year is long."),
    CorpusPassage("b1", "Beta", "Beta is a cold star. It burns blue gas near the core."),
    CorpusPassage("b2", "Beta", "Beta has no planets. Astronomers named it in 1802."),
    CorpusPassage("c1", "Gamma", "Gamma is a comet. Its tail is made of green dust."),
    CorpusPassage("c2", "Gamma", "Gamma returns every 76 years. Halley saw it first."),
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
  assert spec == "OPQ8,IVF2,PQ8x6" and len(notes) == 2
  directory, _, _ = toy
  with pytest.raises(DumpError, match="no index named 'nope'"):
    PhraseIndex(directory, "nope")
  with pytest.raises(DumpError, match="not a phrase dump"):
    Dump.load(tmp_path)
  (tmp_path / "manifest.json").write_text('{"complete": false}')
  with pytest.raises(DumpError, match="incomplete"):
    build_index(tmp_path, "Flat")


def test_rescoring_in_chunks_gives_the_same_results(toy, monkeypatch):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  whole = index.search(q_start, q_end, k=4, unit="passage")
  monkeypatch.setattr("dpjax.search._RESCORE_FLOATS", 1)  # one question per chunk
  chunked = index.search(q_start, q_end, k=4, unit="passage")
  assert [[(p.start_token, p.end_token) for p, _ in u] for u in whole] == \
      [[(p.start_token, p.end_token) for p, _ in u] for u in chunked]
