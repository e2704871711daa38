"""Hybrid search (dense phrase score + weight x BM25) and merged overlapping spans, on the toy
index of test_search.py whose right answers are known."""
import gc
import json
import math
import shutil
from collections import Counter

import numpy as np
import pytest

from dpjax.errors import DumpError
from dpjax.index import hybrid, sparse, units
from dpjax.index.dump import Dump
from dpjax.index.faiss_index import build_index
from dpjax.index.rescoring import Rescorer
from dpjax.index.hybrid import Hybrid
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.scoring import half_to_float32
from conftest import load_script
from test_search import ANSWERS, PASSAGES, _toy_dump

# One question per toy answer (ANSWERS' order), sharing words with its passage.
QUESTIONS = ["Who found Alpha in 1911?", "What does Beta burn near the core?",
             "When did astronomers name Beta?", "What is the tail of Gamma made of?",
             "What are the two moons of Alpha called?"]
LENGTH = 10  # max_answer_length


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  directory = tmp_path_factory.mktemp("toy")
  q_start, q_end = _toy_dump(directory)
  build_index(directory, "Flat")
  dump = Dump.load(directory)
  sparse.build_sparse(directory, dump.passages, dump.manifest)
  return directory, q_start, q_end


def _sentences(passages):
  """[(passage row, first character, "title sentence")] of every sentence, in order."""
  return [(row, a, f"{p.title} {p.text[a:b]}") for row, p in enumerate(passages)
          for a, b in zip(units.sentence_bounds(p.text)[:-1], units.sentence_bounds(p.text)[1:])]


def _bm25_reference(passages, question, k1=0.9, b=0.4, texts=None):
  """Lucene's BM25 (Pyserini's; since Lucene 8 without the (k1 + 1) factor of Robertson's
  formula), spelled out over the index's terms: of the passages, or of `texts` (their
  sentences) as documents of their own (their idf and mean length; a question term no passage
  holds counts in none)."""
  passage_docs = [Counter(terms) for terms in
                  sparse.tokenize([sparse.passage_text(p) for p in passages])]
  docs = passage_docs if texts is None else [Counter(terms) for terms in sparse.tokenize(texts)]
  lengths = np.array([sum(d.values()) for d in docs], float)
  scores = np.zeros(len(docs))
  for term in sparse.tokenize([question])[0]:
    if not any(term in d for d in passage_docs):
      continue
    df = sum(term in d for d in docs)
    idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
    for row, d in enumerate(docs):
      tf = d[term]
      scores[row] += idf * tf / (tf + k1 * (1 - b + b * lengths[row] / lengths.mean()))
  return scores


def test_bm25_scores_are_lucenes(toy):
  directory = toy[0]
  dump = Dump.load(directory)
  index = sparse.SparseIndex(directory, dump.manifest)
  got = index.scores(QUESTIONS)
  for row, question in enumerate(QUESTIONS):
    np.testing.assert_allclose(got[row], _bm25_reference(PASSAGES, question), rtol=1e-5)
  assert got[0].argmax() == ANSWERS[0][0]  # "found Alpha in 1911": the passage that says so
  assert not sparse.SparseIndex(directory, dump.manifest).scores(["zzz qqq"]).any()
  sentences = _sentences(PASSAGES)
  assert index.num_sentences == len(sentences) > len(PASSAGES)
  rows = np.array([row for row, _, _ in sentences])
  chars = np.array([a for _, a, _ in sentences])
  for question, terms in zip(QUESTIONS, index.question_terms(QUESTIONS)):
    np.testing.assert_allclose(index.sentence_scores(terms, rows, chars, PASSAGES),
                               _bm25_reference(PASSAGES, question,
                                               texts=[text for _, _, text in sentences]),
                               rtol=1e-5)


def test_sentence_scores_are_a_bm25s_index_of_the_sentences(toy):
  """The sentence term scores every sentence as a bm25s index of the sentences alone does (what
  a stored sentence index scored) from the stored document frequencies, not that index."""
  directory = toy[0]
  dump = Dump.load(directory)
  index = sparse.SparseIndex(directory, dump.manifest)
  sentences = _sentences(PASSAGES)
  of_sentences = sparse.bm25_of([text for _, _, text in sentences])
  rows = np.array([row for row, _, _ in sentences])
  chars = np.array([a for _, a, _ in sentences])
  for question, terms in zip(QUESTIONS, index.question_terms(QUESTIONS)):
    expected = of_sentences.get_scores(sparse.tokenize([question])[0])
    assert expected.any()
    np.testing.assert_allclose(index.sentence_scores(terms, rows, chars, PASSAGES), expected,
                               rtol=1e-5)


@pytest.mark.parametrize("damage", ["vocabulary", "count", "signed", "header"])
def test_sentence_frequencies_that_do_not_fit_are_refused(toy, tmp_path, damage):
  """A sentence_df.npy of another length, a count above the sentences', a signed array or an
  unreadable one: refused in one line naming the BM25 folder (the manifest records the damaged
  file's size and digest: only the reading catches it)."""
  from dpjax.io import folder_checksums, read_json, write_json
  directory = tmp_path / "dump"
  shutil.copytree(toy[0], directory)
  manifest = Dump.load(directory).manifest
  path = sparse.sparse_folder(directory) / sparse.SENTENCE_DF
  frequency = np.load(path)
  if damage == "vocabulary":
    np.save(path, frequency[:-1])
  elif damage == "count":
    frequency[0] = np.iinfo(frequency.dtype).max
    np.save(path, frequency)
  elif damage == "signed":
    np.save(path, frequency.astype(np.int16))
  else:
    path.write_bytes(b"\x00" * path.stat().st_size)
  recorded = read_json(path.parent / sparse.MANIFEST, DumpError, "")
  recorded["files"] = {k: v for k, v in folder_checksums(path.parent).items()
                       if k in recorded["files"]}
  write_json(path.parent / sparse.MANIFEST, recorded)
  with pytest.raises(DumpError, match="the BM25 index is unreadable") as e:
    sparse.SparseIndex(directory, manifest)
  assert str(sparse.sparse_folder(directory)) in str(e.value) and "\n" not in str(e.value)


def test_every_token_scores_its_sentence_unit_sentence(toy):
  directory = toy[0]
  index = PhraseIndex(directory, "Flat")
  bm25 = sparse.SparseIndex(directory, index.dump.manifest)
  sentences = _sentences(PASSAGES)
  first = {(row, a): i for i, (row, a, _) in enumerate(sentences)}
  tokens = np.arange(index.num_vectors)[::-1]  # (any order)
  for question, terms in zip(QUESTIONS, bm25.question_terms(QUESTIONS)):
    expected = _bm25_reference(PASSAGES, question, texts=[t for _, _, t in sentences])
    got = bm25.sentence_scores(terms, index.dump.token_passage[tokens],
                               index.dump.char_spans[tokens, 0], index.dump.passages)
    phrases = [index.phrase(int(token), int(token), 0.0) for token in tokens]
    np.testing.assert_allclose(got, [expected[first[(p.passage, index.sentence_of(p)[0])]]
                                     for p in phrases], rtol=1e-5)


def test_sentence_scores_are_bm25_by_hand(tmp_path):
  """A small corpus of words the stemmer keeps, scored by hand: idf over the sentences, length
  over their mean length; the BM25 folder holds the passages' index and the sentences' document
  frequencies alone."""
  from dpjax.data.squad import Passage
  texts = ["cat dog. Bird cat cat fish.", "dog tree. Tree tree.", "fish"]
  passages = [Passage(f"p{i}", "zoo", t) for i, t in enumerate(texts)]
  manifest = {"dump_id": "x", "fingerprint": "f", "num_passages": len(passages)}
  folder = sparse.build_sparse(tmp_path, passages, manifest)
  assert sorted(p.name for p in folder.iterdir() if p.name != ".dpjax_verified.json") == [
      "data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy",
      "params.index.json", sparse.SENTENCE_DF, sparse.MANIFEST, "vocab.index.json"]
  index = sparse.SparseIndex(tmp_path, manifest)
  words = [["zoo", "cat", "dog"], ["zoo", "bird", "cat", "cat", "fish"], ["zoo", "dog", "tree"],
           ["zoo", "tree", "tree"], ["zoo", "fish"]]  # each "title sentence"'s terms
  assert sparse.tokenize([t for p in passages for t in sparse.sentence_texts(p)[1]]) == words
  mean = np.mean([len(w) for w in words])
  assert index.manifest["sentence_length"] == pytest.approx(mean)
  question = "Which cat, cat or fish, is not a unicorn?"  # (cat twice, unicorn in no passage)
  expected = []
  for sentence in words:
    score = 0.0
    for term, count in (("cat", 2), ("fish", 1)):
      df = sum(term in w for w in words)  # (cat 2, fish 2 of the 5 sentences)
      idf = math.log(1 + (5 - df + 0.5) / (df + 0.5))
      tf = sentence.count(term)
      score += count * idf * tf / (tf + 0.9 * (1 - 0.4 + 0.4 * len(sentence) / mean))
    expected.append(score)
  terms = index.question_terms([question])[0]
  got = index.sentence_scores(terms, np.array([0, 0, 1, 1, 2]), np.array([0, 9, 0, 10, 0]),
                              passages)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert got[1] > got[0] > 0 and got[2] == got[3] == 0
  # Any character of a sentence maps to it; an order of rows and characters of our own.
  got = index.sentence_scores(terms, np.array([2, 0, 0, 0, 1]), np.array([3, 25, 8, 2, 19]),
                              passages)
  np.testing.assert_allclose(got, np.array(expected)[[4, 1, 0, 0, 3]], rtol=1e-6)


def test_sentence_terms_are_bm25s_tokens():
  """`term_ids` (the sentence term's tokenizer) gives the ids of bm25s's tokens: the toy
  corpus's sentences, stop words, case, digits, accents, one-letter words, nothing at all."""
  import threading
  texts = [t for p in PASSAGES for t in sparse.sentence_texts(p)[1]] + [
      "The THE the", "", "a b c", "Café naïve 1999 x2 e.g. U.S.A.", "running ran runs"]
  tokens = sparse.tokenize(texts)
  vocab = {term: i for i, term in enumerate(sorted({t for found in tokens for t in found}))}
  vocab.pop(tokens[0][0])  # a term the index lacks: -1
  expected = [[vocab.get(t, -1) for t in found] for found in tokens]
  assert sparse.term_ids(texts, vocab) == expected and -1 in expected[0]
  other = []  # (another thread: its own stemmer)
  thread = threading.Thread(target=lambda: other.append(sparse.term_ids(texts, vocab)))
  thread.start()
  thread.join()
  assert other == [expected]


def test_passages_read_without_the_vectors(toy, tmp_path):
  """`Dump.read_passages` (the BM25 row's texts) gives `Dump.load`'s passages; a shard whose
  passages file is gone is named in one line."""
  assert Dump.read_passages(toy[0]) == Dump.load(toy[0]).passages
  copy = tmp_path / "dump"
  shutil.copytree(toy[0], copy)
  shard = json.loads((copy / "manifest.json").read_text())["shards"][0]["name"]
  (copy / shard / "passages.jsonl").unlink()
  with pytest.raises(DumpError, match=f"{shard}: passages missing or damaged"):
    Dump.read_passages(copy)


def test_bm25_peer_ranks_as_the_index_scores(toy):
  """The BM25 peer of the benchmarks (`passage_retrieval.bm25_retrieve`) is this index's BM25:
  its top passages and scores are the index's, question by question."""
  peer = load_script("experiments/benchmarks/passage_retrieval.py")
  dump = Dump.load(toy[0])
  scores = sparse.SparseIndex(toy[0], dump.manifest).scores(QUESTIONS)
  rows, got, info = peer.bm25_retrieve(dump.passages, QUESTIONS, 3)
  assert (info["k1"], info["b"]) == (sparse.SETTINGS["k1"], sparse.SETTINGS["b"])
  for q, (found, values) in enumerate(zip(rows, got)):
    np.testing.assert_allclose(values, scores[q, found], rtol=1e-5)
    np.testing.assert_allclose(values, np.sort(scores[q])[::-1][:3], rtol=1e-5)


def _exhaustive(vectors, token_passage, q_start, q_end, tokens):
  """Every token of `tokens` as a start with its best end, and as an end with its best start
  (nearest on ties), within LENGTH tokens of one passage: {(start, end): score}."""
  s, e = vectors[tokens] @ q_start, vectors[tokens] @ q_end
  found = {}
  for a, i in enumerate(tokens):
    ends = [b for b in range(a, min(a + LENGTH, len(tokens)))
            if token_passage[tokens[b]] == token_passage[i]]
    b = max(ends, key=lambda b: (s[a] + e[b], -b))
    found.setdefault((int(i), int(tokens[b])), float(s[a] + e[b]))
    starts = [c for c in range(max(a - LENGTH + 1, 0), a + 1)
              if token_passage[tokens[c]] == token_passage[i]]
    c = max(starts, key=lambda c: (s[c] + e[a], c))
    found.setdefault((int(tokens[c]), int(i)), float(s[c] + e[a]))
  return found


@pytest.mark.parametrize("weight,sentence_weight", [(0.05, 0.0), (0.5, 0.0), (3.0, 0.0),
                                                    (0.5, 1.5), (0.0, 2.0)])
def test_fused_ranking_equals_a_numpy_reference(toy, weight, sentence_weight):
  directory, q_start, q_end = toy
  dump = Dump.load(directory)
  bm25 = sparse.SparseIndex(directory, dump.manifest)
  index = PhraseIndex(dump, "Flat", merge_spans=False,
                      hybrid=Hybrid(bm25, weight, sentence_weight, passages=2))
  found = index.search(q_start, q_end, k=8, unit="phrase", texts=QUESTIONS,
                       max_answer_length=LENGTH)
  vectors = half_to_float32(np.asarray(index.dump.vectors))
  lexical = bm25.scores(QUESTIONS)
  sentences = _sentences(PASSAGES)
  first = {(row, a): i for i, (row, a, _) in enumerate(sentences)}

  def sentence_score(q, start):  # the BM25 of the sentence holding the span's first character
    phrase = index.phrase(start, start, 0.0)
    return _bm25_reference(PASSAGES, QUESTIONS[q], texts=[t for _, _, t in sentences])[
        first[(phrase.passage, index.sentence_of(phrase)[0])]]

  for q in range(len(QUESTIONS)):
    fetch = index.fetch_bounds(8)[0]
    starts, ends, scores = index._spans(q_start[q:q + 1], q_end[q:q + 1], fetch, LENGTH)[0]
    candidates = {}
    for s, e, x in zip(starts[:fetch], ends[:fetch], scores[:fetch]):
      candidates.setdefault((int(s), int(e)), float(x))
    for p in np.argsort(-lexical[q], kind="stable")[:2]:
      tokens = np.arange(index.passage_start[p], index.passage_end[p])
      for span, x in _exhaustive(vectors, index.dump.token_passage, q_start[q], q_end[q],
                                 tokens).items():
        candidates.setdefault(span, x)
    ranked = sorted(((x + weight * lexical[q][index.dump.token_passage[s]]
                      + sentence_weight * sentence_score(q, s), (s, e))
                     for (s, e), x in candidates.items()), key=lambda t: -t[0])[:8]
    assert [(p.start_token, p.end_token) for p, _ in found[q]] == [span for _, span in ranked]
    np.testing.assert_allclose([p.score for p, _ in found[q]], [x for x, _ in ranked],
                               rtol=1e-5, atol=1e-5)


def test_weight_zero_is_the_dense_search(toy):
  directory, q_start, q_end = toy
  dense = PhraseIndex(directory, "Flat")
  fused = dense.with_options(hybrid=Hybrid(sparse.SparseIndex(directory, dense.dump.manifest),
                                           0.0, 0.0))
  assert dense.hybrid is None and not fused.hybrid.active
  for unit in ("phrase", "sentence", "passage", "document"):
    a = dense.search(q_start, q_end, k=4, unit=unit)
    b = fused.search(q_start, q_end, k=4, unit=unit, texts=QUESTIONS)
    assert [[(p.start_token, p.end_token, p.score) for p, _ in u] for u in a] == [
        [(p.start_token, p.end_token, p.score) for p, _ in u] for u in b]


def test_a_passage_only_bm25_finds_is_scored_as_an_exhaustive_search(toy):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  # Question 0's vectors point at passage 1; its text shares words only with passage 5.
  text = ["Halley returns every 76 years?"]
  starts = index._spans(q_start[:1], q_end[:1], 2, LENGTH)[0][0]  # the dense candidates
  assert 5 not in index.dump.token_passage[starts]
  bm25 = sparse.SparseIndex(directory, index.dump.manifest)
  lexical = bm25.scores(text)[0]
  # BM25's passage wins whatever its dense score
  index = index.with_options(hybrid=Hybrid(bm25, 1000.0, passages=1))
  top = index.search(q_start[:1], q_end[:1], k=1, unit="passage", top_tokens=2, texts=text)[0][0][0]
  alone = PhraseIndex.over_passages(index.dump, [5])
  exact = alone.search(q_start[:1], q_end[:1], k=1, unit="phrase",
                       top_tokens=alone.num_vectors)[0][0][0]
  assert top.passage == 5 and (top.start_token, top.end_token) == (exact.start_token,
                                                                    exact.end_token)
  assert top.score == pytest.approx(exact.score + 1000.0 * lexical[5], rel=1e-6)


def test_missing_damaged_or_foreign_bm25_index_refused(toy, tmp_path):
  directory = toy[0]
  other = tmp_path / "other"
  _toy_dump(other)
  build_index(other, "Flat")
  manifest = Dump.load(other).manifest
  with pytest.raises(DumpError, match=r"no BM25 index .*run.py index --set index.sparse=True"):
    sparse.SparseIndex(other, manifest)
  # Another dump's BM25 index (its passages differ: another corpus) is refused by name.
  shutil.copytree(sparse.sparse_folder(directory), sparse.sparse_folder(other))
  record = json.loads((sparse.sparse_folder(other) / sparse.MANIFEST).read_text())
  record["dump_id"] = "another"
  (sparse.sparse_folder(other) / sparse.MANIFEST).write_text(json.dumps(record))
  with pytest.raises(DumpError, match=r"indexes/bm25 was built from another dump"):
    sparse.SparseIndex(other, manifest)
  record["dump_id"] = manifest.get("dump_id", "")
  (sparse.sparse_folder(other) / sparse.MANIFEST).write_text(json.dumps(record))
  damaged = sparse.sparse_folder(other) / "vocab.index.json"
  damaged.write_text(damaged.read_text() + " ")
  with pytest.raises(DumpError, match=r"vocab.index.json: .*bytes.*BM25 index is damaged"):
    sparse.SparseIndex(other, manifest)
  # One of an older dpjax, with an index of the sentences in a folder of its own: refused, and
  # built again without it.
  shutil.rmtree(sparse.sparse_folder(other))
  shutil.copytree(sparse.sparse_folder(directory), sparse.sparse_folder(other))
  shutil.copytree(sparse.sparse_folder(directory), sparse.sparse_folder(other) / "sentences",
                  ignore=shutil.ignore_patterns(sparse.MANIFEST))
  record = json.loads((sparse.sparse_folder(other) / sparse.MANIFEST).read_text())
  record["settings"]["sentences"] = "title sentence (units.sentence_bounds), in folder sentences/"
  (sparse.sparse_folder(other) / sparse.MANIFEST).write_text(json.dumps(record))
  with pytest.raises(DumpError, match=r"a BM25 index of other settings .*in folder sentences/"
                                      r".*run.py index --set index.sparse=True"):
    sparse.SparseIndex(other, manifest)
  sparse.build_sparse(other, Dump.load(other).passages, manifest)
  assert sparse.SparseIndex(other, manifest).num_sentences == len(_sentences(PASSAGES))
  assert not (sparse.sparse_folder(other) / "sentences").exists()
  bm25 = sparse.SparseIndex(directory, Dump.load(directory).manifest)
  index = PhraseIndex(directory, "Flat", hybrid=Hybrid(bm25, 1.0))
  with pytest.raises(ValueError, match="needs the text of every question"):
    index.search(toy[1], toy[2], k=2)
  with pytest.raises(ValueError, match="a sentence weight without the passage weight"):
    Hybrid.of(bm25, sentence_weight=1.0)
  for weight in (float("nan"), float("inf"), None, "1", True):
    with pytest.raises(ValueError, match="weight must be a finite number"):
      Hybrid(bm25, weight)
  with pytest.raises(TypeError, match="hybrid must be a dpjax.index.hybrid.Hybrid"):
    index.with_options(hybrid=bm25)
  # One of other BM25 settings (here another k1): refused, and built again.
  record = json.loads((sparse.sparse_folder(other) / sparse.MANIFEST).read_text())
  record["settings"] = {**record["settings"], "k1": 1.2}
  (sparse.sparse_folder(other) / sparse.MANIFEST).write_text(json.dumps(record))
  with pytest.raises(DumpError, match=r"a BM25 index of other settings .*'k1': 1.2"):
    sparse.SparseIndex(other, manifest)
  sparse.build_sparse(other, Dump.load(other).passages, manifest)
  assert sparse.SparseIndex(other, manifest).manifest["settings"]["k1"] == sparse.SETTINGS["k1"]


def test_overlapping_spans_are_one_answer_with_the_others_as_evidence(toy):
  directory, q_start, q_end = toy
  merged = PhraseIndex(directory, "Flat")
  apart = merged.with_options(merge_spans=False)
  assert merged.merge_spans and not apart.merge_spans
  for q in range(len(q_start)):
    # One round of 60 hits each: both rank the same candidate spans.
    one = [p for p, _ in merged.search(q_start[q:q + 1], q_end[q:q + 1], k=6, top_tokens=60,
                                       max_fetch=60)[0]]
    all_spans = [p for p, _ in apart.search(q_start[q:q + 1], q_end[q:q + 1], k=60,
                                            top_tokens=60, max_fetch=60)[0]]
    for a in range(len(one)):  # no two answers overlap
      for b in range(a):
        assert one[a].end_token < one[b].start_token or one[b].end_token < one[a].start_token
    # The answers are the greedy groups of the unmerged ranking: leads in order, evidence kept.
    leads, others = hybrid.overlap_groups(np.array([p.start_token for p in all_spans]),
                                          np.array([p.end_token for p in all_spans]), 6)
    assert [(p.start_token, p.end_token, p.score) for p in one] == [
        (all_spans[i].start_token, all_spans[i].end_token, all_spans[i].score) for i in leads]
    for p, rows in zip(one, others):
      assert [(m.start_token, m.end_token) for m in p.merged] == [
          (all_spans[i].start_token, all_spans[i].end_token) for i in rows]
      assert all(m.start_token <= p.end_token and p.start_token <= m.end_token
                 for m in p.merged)
  with_evidence = [p for p, _ in merged.search(q_start, q_end, k=3)[0] if p.merged]
  result = merged.result(with_evidence[0])
  assert set(result["merged"][0]) == {"answer", "score", "start_char", "end_char"}
  assert result["merged"][0]["score"] <= result["score"]


def test_overlap_groups_by_hand():
  starts, ends = np.array([5, 6, 20, 4, 30, 21, 40]), np.array([7, 6, 22, 5, 31, 25, 41])
  assert hybrid.overlap_groups(starts, ends, 3) == ([0, 2, 4], [[1, 3], [5], []])
  # It stops at the first span of a group past the k-th: later evidence is not looked for.
  assert hybrid.overlap_groups(starts, ends, 1) == ([0], [[1]])


@pytest.mark.parametrize("unit", ["phrase", "passage", "document"])
def test_hybrid_on_the_devices_answers_as_on_the_host(toy, unit):
  """The accelerator's exact search (DeviceFlat; here the CPU devices) under the same fusion."""
  directory, q_start, q_end = toy
  found = []
  for device in ("faiss", "jax"):
    bm25 = sparse.SparseIndex(directory, Dump.load(directory).manifest)
    index = PhraseIndex(directory, "Flat", search_device=device,
                        hybrid=Hybrid(bm25, 0.7, 0.4, passages=3))
    found.append([[(p.start_token, p.end_token) for p, _ in units] for units in index.search(
        q_start, q_end, k=3, unit=unit, texts=QUESTIONS)])
  assert found[0] == found[1]


def test_passages_rank_as_their_best_fused_phrase(toy):
  directory, q_start, q_end = toy
  bm25 = sparse.SparseIndex(directory, Dump.load(directory).manifest)
  index = PhraseIndex(directory, "Flat", merge_spans=False, hybrid=Hybrid(bm25, 0.3, passages=2))
  phrases = index.search(q_start, q_end, k=40, unit="phrase", texts=QUESTIONS, top_tokens=40,
                         max_fetch=40)
  passages = index.search(q_start, q_end, k=3, unit="passage", texts=QUESTIONS, top_tokens=40,
                          max_fetch=40)
  for ranked, units in zip(phrases, passages):  # (the 40 phrases may hold fewer passages)
    order = list(dict.fromkeys(p.passage for p, _ in ranked))[:3]
    assert order and [p.passage for p, _ in units][:len(order)] == order
    best = {p.passage: p.score for p, _ in reversed(ranked)}
    assert [p.score for p, _ in units][:len(order)] == [best[row] for row in order]


def test_a_filtered_index_fuses_only_the_tokens_it_keeps(toy):
  directory, q_start, q_end = toy
  dump = Dump.load(directory)
  kept = np.arange(0, len(dump.vectors), 2)  # every other token
  index = PhraseIndex.over_tokens(dump, kept, merge_spans=False).with_options(
      hybrid=Hybrid(sparse.SparseIndex(directory, dump.manifest), 5.0, passages=3))
  found = index.search(q_start, q_end, k=30, unit="phrase", texts=QUESTIONS)
  spans = [(p.start_token, p.end_token) for units in found for p, _ in units]
  assert spans and all(s % 2 == 0 and e % 2 == 0 for s, e in spans)


def test_a_rescorer_outlives_its_phrase_index(toy):
  """An exact index's rescorer reads the faiss index's own storage: kept after its phrase
  index is gone, it still scores from live memory (the view holds the index)."""
  directory, q_start, q_end = toy
  rescorer = PhraseIndex(directory, "Flat").rescorer
  gc.collect()
  assert rescorer.vectors.owner is not None
  want = half_to_float32(np.asarray(Dump.load(directory).vectors))[:10] @ q_start[0]
  got = rescorer.token_scores(np.arange(10)[None], q_start[:1], q_end[:1])[0][0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kept", [None, "every other", "compact"])
def test_passage_spans_score_each_token_once_as_the_rescoring_does(toy, kept):
  """The BM25 passages' spans (their tokens' scores looked up by slot) are those of the
  rescoring scoring every partner itself: over the dump, a filtered index's kept tokens, and
  rows of kept tokens with their dump places (a compact index's `positions`)."""
  directory, q_start, q_end = toy
  dump = Dump.load(directory)
  rescorer = PhraseIndex(directory, "Flat").rescorer
  if kept == "every other":
    rescorer = PhraseIndex.over_tokens(dump, np.arange(0, len(dump.vectors), 2)).rescorer
  elif kept == "compact":  # rows: every other token, numbered passage by passage
    rows = np.arange(0, len(dump.vectors), 2)
    passage = np.asarray(dump.token_passage)[rows]
    offsets = np.searchsorted(passage, np.arange(len(dump.passages) + 1))
    places = rows - np.searchsorted(np.asarray(dump.token_passage), passage)
    rescorer = Rescorer.over_offsets(np.asarray(dump.vectors)[rows], offsets, places)
  bm25 = sparse.SparseIndex(directory, dump.manifest)
  passages = hybrid.top_passages(bm25.scores(QUESTIONS), 3)
  found = hybrid.lexical_spans(rescorer, q_start, q_end, passages, LENGTH)
  for q, rows in enumerate(passages):
    tokens = rescorer.passage_tokens(rows)[None]
    scores, starts, ends = rescorer.rescore(q_start[q:q + 1], q_end[q:q + 1], tokens, tokens,
                                            LENGTH)
    keep = np.isfinite(scores[0])
    assert keep.any()
    for got, want in zip(found[q], (starts[0, keep], ends[0, keep], scores[0, keep])):
      np.testing.assert_array_equal(got, want)


def test_exhaustive_rescoring_stays_within_its_bound(toy, monkeypatch):
  """Calls are sized by their widest row: a question without BM25 passages (no shared term) in
  the batch does not make one call of every question at the widest width."""
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  bm25 = sparse.SparseIndex(directory, index.dump.manifest)
  texts = QUESTIONS[:4] + ["Xyzzy plugh?"]
  passages = hybrid.top_passages(bm25.scores(texts), 3)
  assert not len(passages[-1]) and all(len(p) for p in passages[:-1])
  shapes, best = [], hybrid._best_partners
  monkeypatch.setattr(hybrid, "_best_partners", lambda rescorer, qs, qe, layouts, n: shapes.append(
      (len(layouts), max(total for *_, total in layouts))) or best(rescorer, qs, qe, layouts, n))
  bound = 2 * 60 * LENGTH * 2  # two rows of 60 anchors
  monkeypatch.setattr(hybrid, "_EXHAUSTIVE_ELEMENTS", bound)
  chunked = hybrid.lexical_spans(index.rescorer, q_start, q_end, passages, LENGTH)
  assert all(rows == 1 or 2 * rows * width * LENGTH <= bound for rows, width in shapes)
  assert len(shapes) > 1
  monkeypatch.setattr(hybrid, "_EXHAUSTIVE_ELEMENTS", 1 << 22)
  whole = hybrid.lexical_spans(index.rescorer, q_start, q_end, passages, LENGTH)
  assert all(all(np.array_equal(a, b) for a, b in zip(x, y)) for x, y in zip(chunked, whole))


def test_ties_at_the_cut_go_to_the_lower_row():
  scores = np.array([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
  assert hybrid.top_passages(scores, 3)[0].tolist() == [1, 2, 3]
  assert hybrid.top_passages(scores, 6)[0].tolist() == [1, 2, 3, 4, 0]  # no shared term: out


def test_bm25_of_the_questions_computed_once_for_their_requests(toy, monkeypatch):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  bm25 = sparse.SparseIndex(directory, index.dump.manifest)
  calls = []
  monkeypatch.setattr(bm25, "scores", lambda texts, real=bm25.scores: calls.append(1) or
                      real(texts))
  index = index.with_options(hybrid=Hybrid(bm25, 1.0))
  first = index.search(q_start, q_end, k=3, unit="phrase", texts=QUESTIONS)
  index.search(q_start, q_end, k=5, unit="passage", texts=QUESTIONS)
  # another weight: a copy sharing the last questions' lexical results
  index.with_options(hybrid=Hybrid(bm25, 2.0)).search(q_start, q_end, k=3, unit="phrase",
                                                      texts=QUESTIONS)
  assert len(calls) == 1
  other = list(QUESTIONS[::-1])
  index.search(q_start, q_end, k=3, unit="phrase", texts=other)  # other texts: computed again
  assert len(calls) == 2
  again = index.search(q_start, q_end, k=3, unit="phrase", texts=QUESTIONS)
  assert [[(p.start_token, p.end_token, p.score) for p, _ in u] for u in again] == [
      [(p.start_token, p.end_token, p.score) for p, _ in u] for u in first]


def test_bad_hybrid_inputs_are_one_clear_error(toy, tmp_path):
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  index = index.with_options(hybrid=Hybrid(sparse.SparseIndex(directory, index.dump.manifest),
                                           1.0))
  with pytest.raises(ValueError, match="max_answer_length .* must be >= 1"):
    index.search(q_start, q_end, k=2, texts=QUESTIONS, max_answer_length=0)
  # Another dump's BM25 index, both without a dump id (made from Python): refused by its size.
  small = tmp_path / "small"
  shutil.copytree(directory, small)
  dump = Dump.load(small)
  shutil.rmtree(sparse.sparse_folder(small))
  sparse.build_sparse(small, dump.passages[:3], {**dump.manifest, "num_passages": 3})
  foreign = sparse.SparseIndex(small, {**dump.manifest, "num_passages": 3})
  with pytest.raises(DumpError, match="built from another dump"):
    index.with_options(hybrid=Hybrid(foreign, 1.0))
  # Damage that keeps a file's size: unreadable, one line naming the folder and the rebuild.
  vocab = sparse.sparse_folder(small) / "vocab.index.json"
  vocab.write_bytes(b"\0" * 8 + vocab.read_bytes()[8:])
  with pytest.raises(DumpError, match=r"indexes/bm25: the BM25 index is unreadable .*"
                                      r"run.py index --set index.sparse=True"):
    sparse.SparseIndex(small, {**dump.manifest, "num_passages": 3})


def test_document_frequencies_out_of_order_are_refused(toy, tmp_path):
  """Damage to the passages' score columns, keeping their size (unchecked unless verified):
  one line."""
  copy = tmp_path / "copy"
  shutil.copytree(toy[0], copy)
  path = sparse.sparse_folder(copy) / "indptr.csc.index.npy"
  np.save(path, np.load(path)[::-1].copy())
  with pytest.raises(DumpError, match=r"unreadable .*columns do not match the vocabulary"):
    sparse.SparseIndex(copy, Dump.load(copy).manifest)


def test_sentences_of_awkward_passages(tmp_path):
  """Empty passages, leading whitespace, no sentence end, abbreviations: every character scores
  the sentence `units.sentence_bounds` puts it in."""
  from dpjax.data.squad import Passage
  texts = ["", "  Leading space. Then more words here.", "no sentence end at all",
           "Dr. Smith went home. He slept! Did he? Yes.", ""]
  passages = [Passage(f"p{i}", "T", t) for i, t in enumerate(texts)]
  manifest = {"dump_id": "x", "fingerprint": "f", "num_passages": len(passages)}
  sparse.build_sparse(tmp_path, passages, manifest)
  index = sparse.SparseIndex(tmp_path, manifest)
  sentences = _sentences(passages)
  assert index.num_sentences == len(sentences)
  question = "Did Smith sleep, leading words, then more at the end?"
  expected = _bm25_reference(passages, question, texts=[t for _, _, t in sentences])
  assert len(set(expected.round(6))) > 4  # (the sentences score apart)
  rows = np.array([row for row, text in enumerate(texts) for _ in text])
  chars = np.array([char for text in texts for char in range(len(text))])
  got = index.sentence_scores(index.question_terms([question])[0], rows, chars, passages)
  first = {(row, a): i for i, (row, a, _) in enumerate(sentences)}
  for score, row, char in zip(got, rows, chars):
    bounds = units.sentence_bounds(texts[row])
    start = max(a for a in bounds[:-1] if a <= char)
    assert score == pytest.approx(expected[first[(row, start)]], rel=1e-5), (row, char)


def test_a_grid_of_weights_ranks_candidates_made_once(toy, monkeypatch):
  """Searches of the same questions with other weights (copies sharing the lexical results)
  rank the candidates the first search made (`hybrid.candidates` once per question and dense
  spans) and answer as a searcher of that weight alone does."""
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  bm25 = sparse.SparseIndex(directory, index.dump.manifest)
  made = []
  monkeypatch.setattr(hybrid, "candidates", lambda *args, real=hybrid.candidates:
                      made.append(1) or real(*args))

  def answers(hybrid_index):
    return [[(p.start_token, p.end_token, p.score) for p, _ in u]
            for u in hybrid_index.search(q_start, q_end, k=3, unit="phrase", texts=QUESTIONS)]

  grid = [(0.5, 0.0), (2.0, 1.0), (0.0, 2.0)]
  shared = [answers(index.with_options(hybrid=Hybrid(bm25, *pair))) for pair in grid]
  assert len(made) == len(QUESTIONS)
  for pair, found in zip(grid, shared):
    alone = PhraseIndex(directory, "Flat").with_options(
        hybrid=Hybrid(sparse.SparseIndex(directory, index.dump.manifest), *pair))
    assert answers(alone) == found
  assert shared[0] != shared[1]  # (the weights change the answers)


def test_sentences_tokenized_once_while_cached(toy, monkeypatch):
  """The searches of one question (requests, weights) score a passage's sentences once; other
  questions reuse its tokenized sentences; a cache of two passages gives the same answers."""
  directory, q_start, q_end = toy
  index = PhraseIndex(directory, "Flat")
  bm25 = sparse.SparseIndex(directory, index.dump.manifest)
  tokenized, scored = [], []
  monkeypatch.setattr(bm25, "_tokenize_passages", lambda passages, real=bm25._tokenize_passages:
                      tokenized.extend(p.id for p in passages) or real(passages))
  monkeypatch.setattr(bm25, "_score", lambda terms, found, real=bm25._score:
                      scored.append(len(found)) or real(terms, found))

  def answers(hybrid_index, texts):
    return [[(p.start_token, p.end_token, p.score) for p, _ in u] for unit in ("phrase", "passage")
            for u in hybrid_index.search(q_start, q_end, k=3, unit=unit, texts=texts)]

  first = answers(index.with_options(hybrid=Hybrid(bm25, 0.5, 1.0, passages=3)), QUESTIONS)
  answers(index.with_options(hybrid=Hybrid(bm25, 0.0, 2.0, passages=3)), QUESTIONS)
  assert tokenized and len(tokenized) == len(set(tokenized)) <= len(PASSAGES)
  assert sum(scored) <= len(QUESTIONS) * len(PASSAGES)  # (each question's passages once)
  answers(index.with_options(hybrid=Hybrid(bm25, 0.5, 1.0, passages=3)), QUESTIONS[::-1])
  assert len(tokenized) == len(set(tokenized))  # (other questions: the cached passages)
  monkeypatch.setattr(sparse, "SENTENCE_CACHE_PASSAGES", 2)
  small = sparse.SparseIndex(directory, index.dump.manifest)
  assert answers(index.with_options(hybrid=Hybrid(small, 0.5, 1.0, passages=3)),
                 QUESTIONS) == first
  assert len(small._sentences) == 2


@pytest.mark.slow
def test_squad_configs_search_hybrid_by_default(tmp_path, caplog):
  """`run.py index` of a SQuAD config builds the BM25 index and chooses its weights, and eval
  fuses it unless `index.sparse=False`; the log says which search ran."""
  import logging

  import run
  from dpjax.config import load_config
  from dpjax.data.synthetic import write_synthetic
  for arg in ("", "paper", "cpu", "cpu-base", "tiny"):
    assert load_config(f"experiments/squad.py:{arg}" if arg else "experiments/squad.py"
                       ).index.sparse, arg
  data = tmp_path / "squad"
  files = write_synthetic(data, seed=0, num_train_entities=6, num_dev_entities=4,
                          questions_per_entity=3)
  files["train"].rename(data / "train-v1.1.json")
  files["dev"].rename(data / "dev-v1.1.json")
  workdir = tmp_path / "w"
  base = ["--config", "experiments/squad.py:tiny", "--workdir", str(workdir),
          "--set", f"data.dir={data}", "--set", "eval.limit=6",
          "--set", "index.sparse_tune_questions=12", "--set", "index.specs=['Flat']"]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0, mode
  recorded = json.loads((sparse.sparse_folder(workdir / "dump") / sparse.MANIFEST).read_text())
  assert recorded["weight_tuning"]["questions"] == 12
  caplog.set_level(logging.INFO, logger="dpjax.loading")
  assert run.main(["eval"] + base) == 0
  report = json.loads((workdir / "open_eval_Flat_hybrid.json").read_text())
  assert (report["hybrid"]["weight"], report["hybrid"]["sentence_weight"]) == (
      recorded["weight"], recorded["sentence_weight"])
  weight, sentence_weight, dump = recorded["weight"], recorded["sentence_weight"], workdir / "dump"
  expected = (f"search: hybrid search (dense + {weight:g} x passage BM25 + {sentence_weight:g} x "
              f"sentence BM25, top 20 BM25 passages) over index Flat of {dump}"
              if weight or sentence_weight else
              f"search: dense phrase search (hybrid weights 0 and 0) over index Flat of {dump}")
  assert [r.getMessage() for r in caplog.records
          if r.getMessage().startswith("search: ")] == [expected]
  caplog.clear()
  assert run.main(["eval"] + base + ["--set", "index.sparse=False"]) == 0
  assert json.loads((workdir / "open_eval_Flat.json").read_text())["hybrid"] is None
  assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("search: ")] == [
      f"search: dense phrase search over index Flat of {workdir / 'dump'}"]


def test_hybrid_weights_are_chosen_again_for_another_checkpoint(tmp_path):
  """A recorded weight holds for the settings it was chosen with, the checkpoint among them: the
  question encoders of QSFT (`eval.checkpoint=qsft`) choose it again."""
  import dataclasses

  from dpjax.config import load_config
  from dpjax.index import hybrid_weights
  from dpjax.settings import Settings
  from dpjax.workdir import Workdir
  settings = Settings.of(load_config("experiments/demo.py:tiny"))
  evaluation, index = settings.eval, settings.index
  folder = sparse.sparse_folder(Workdir(tmp_path).dump(index.dump_name))
  folder.mkdir(parents=True)
  record = {"weight": 1.0, "sentence_weight": 0.5,
            "weight_tuning": hybrid_weights._tuned_for(evaluation, index)}
  (folder / sparse.MANIFEST).write_text(json.dumps(record))
  assert record["weight_tuning"]["checkpoint"] == evaluation.checkpoint == "latest"
  assert hybrid_weights._weight_kept(evaluation, index, Workdir(tmp_path))
  qsft = dataclasses.replace(evaluation, checkpoint="qsft")
  assert not hybrid_weights._weight_kept(qsft, index, Workdir(tmp_path))
  other = dataclasses.replace(index, search_index="compact")
  assert not hybrid_weights._weight_kept(evaluation, other, Workdir(tmp_path))
  # re-reading: weights recorded before it existed were chosen without it
  reread = dataclasses.replace(index, reread=3)
  assert not hybrid_weights._weight_kept(evaluation, reread, Workdir(tmp_path))
  del record["weight_tuning"]["reread"]
  (folder / sparse.MANIFEST).write_text(json.dumps(record))
  assert hybrid_weights._weight_kept(evaluation, index, Workdir(tmp_path))
  assert not hybrid_weights._weight_kept(evaluation, reread, Workdir(tmp_path))
  # ... and without a margin (recorded before it existed)
  record["weight_tuning"] = hybrid_weights._tuned_for(evaluation, reread)
  del record["weight_tuning"]["reread_margin"]
  (folder / sparse.MANIFEST).write_text(json.dumps(record))
  assert hybrid_weights._weight_kept(evaluation, reread, Workdir(tmp_path))
  margin = dataclasses.replace(reread, reread_margin=4.0)
  assert not hybrid_weights._weight_kept(evaluation, margin, Workdir(tmp_path))
