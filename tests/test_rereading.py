"""Re-reading (`index.reread`, `dpjax.index.rereading`) on the tiny trained workdir: the re-read
vectors are the dump's, re-reading an exact index keeps its answers, re-reading a coarse compact
index brings them back toward the exact ones, and eval runs it end to end."""
import dataclasses
import json
import shutil

import numpy as np
import pytest
from flax import nnx

from conftest import phrase_questions

import run
from dpjax.config import load_settings
from dpjax.data.tokenization import Tokenizer
from dpjax.errors import DumpError
from dpjax.index import rereading
from dpjax.index.faiss_index import build_index
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.rereading import Rereader
from dpjax.index.search import PhraseSearcher
from dpjax.loading import restore_model
from dpjax.main import open_workdir
from dpjax.models import model_for_data

CONFIG = "experiments/demo.py:tiny"
QUESTIONS = 53


@pytest.fixture(scope="module")
def workdir(tiny_workdir, tmp_path_factory):
  """A copy of the tiny workdir with a coarse compact index (3 bytes per token)."""
  directory = tmp_path_factory.mktemp("reread") / "demo"
  shutil.copytree(tiny_workdir, directory)
  build_index(directory / "dump", "compact:PQ3")
  return directory


@pytest.fixture(scope="module")
def model(workdir):
  s = load_settings(CONFIG, [])
  return restore_model(s.model, s.data, s.eval, workdir)[0]


def _rereader(model, index: PhraseIndex, passages: int = 2, **kwargs) -> Rereader:
  return Rereader(model, Tokenizer.from_pretrained(index.dump.manifest["model"]["tokenizer"]),
                  index.dump.manifest, passages, **kwargs)


def _top1(index: PhraseIndex, q_start, q_end):
  return [(units[0][0].passage, units[0][0].start_char, units[0][0].end_char, units[0][0].score)
          for units in index.search(q_start, q_end, 5)]


def test_re_read_vectors_are_the_dumps(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  rows = [5, 0, 17, 5]  # (one read twice)
  read = _rereader(model, flat).read(rows, flat.dump.passages)
  for row, (vectors, spans) in zip(rows, read):
    tokens = np.arange(flat.passage_start[row], flat.passage_end[row])
    np.testing.assert_array_equal(spans, flat.dump.char_spans[tokens])
    np.testing.assert_allclose(np.asarray(vectors, np.float32),
                               np.asarray(flat.dump.vectors[tokens], np.float32),
                               rtol=2e-2, atol=2e-2)


def test_re_reading_an_exact_index_keeps_its_answers(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  q_start, q_end = phrase_questions(flat.dump.vectors, QUESTIONS, 3)
  theirs = _top1(flat, q_start, q_end)
  ours = _top1(flat.with_options(reread=_rereader(model, flat)), q_start, q_end)
  # The top span is re-read from vectors equal up to the encoder's rounding: the same span at
  # the same score (the best re-read span takes the search's best score).
  assert [a[:3] for a in ours] == [a[:3] for a in theirs]
  np.testing.assert_allclose([a[3] for a in ours], [a[3] for a in theirs], rtol=1e-6)


def test_re_reading_a_coarse_compact_index_brings_back_the_exact_answers(workdir, model,
                                                                          monkeypatch):
  flat, compact = PhraseIndex(workdir / "dump", "Flat"), PhraseIndex(workdir / "dump",
                                                                     "compact:PQ3")
  q_start, q_end = phrase_questions(flat.dump.vectors, QUESTIONS, 5)
  exact = [a[:3] for a in _top1(flat, q_start, q_end)]
  coded = [a[:3] for a in _top1(compact, q_start, q_end)]
  reader, picked = _rereader(model, compact, 3), []
  read_spans = rereading.read_spans
  monkeypatch.setattr(rereading, "read_spans",
                      lambda *args, **kwargs: picked.extend(args[4]) or read_spans(*args, **kwargs))
  reread = [a[:3] for a in _top1(compact.with_options(reread=reader), q_start, q_end)]
  assert len(picked) == QUESTIONS and all(len(rows) == 3 for rows in picked)
  # A question whose exact answer lies in one of its 3 re-read passages gets it: the exact best
  # span of all passages is the best of those three.
  covered = [answer[0] in rows for answer, rows in zip(exact, picked)]
  assert [found for found, c in zip(reread, covered) if c] == [
      answer for answer, c in zip(exact, covered) if c]
  before, after = (np.mean([a == b for a, b in zip(found, exact)]) for found in (coded, reread))
  assert after >= np.mean(covered) > before + 0.2, (before, np.mean(covered), after)
  encoded = reader.encoded_passages
  compact.with_options(reread=reader).search(q_start, q_end, 5)  # the same questions again
  assert reader.encoded_passages == encoded  # read from the cache


def test_a_search_re_reads_as_many_passages_as_asked(workdir, model, monkeypatch):
  flat, compact = PhraseIndex(workdir / "dump", "Flat"), PhraseIndex(workdir / "dump",
                                                                     "compact:PQ3")
  q_start, q_end = phrase_questions(flat.dump.vectors, QUESTIONS, 5)
  rounds, picked = [], []
  reread, read_spans = PhraseIndex._reread, rereading.read_spans
  monkeypatch.setattr(PhraseIndex, "_reread", lambda self, *args: rounds.append(
      args[2].tolist()) or reread(self, *args))
  monkeypatch.setattr(rereading, "read_spans",
                      lambda *args, **kwargs: picked.append(args[4]) or read_spans(*args, **kwargs))
  reader = _rereader(model, compact, 8)
  assert compact.with_options(reread=reader).fetch_bounds(1, top_tokens=2)[0] == 16  # 2 R
  # From two phrases (one or two passages) the search fetches wider until they hold 8.
  bounds = PhraseIndex.fetch_bounds
  monkeypatch.setattr(PhraseIndex, "fetch_bounds",
                      lambda self, k, **kwargs: (2, bounds(self, k, **kwargs)[1]))
  compact.with_options(reread=reader).search(q_start, q_end, 1, top_tokens=2)
  last = {q: len(rows) for questions, picks in zip(rounds, picked)
          for q, rows in zip(questions, picks)}  # each question's passages in its last round
  assert len(rounds) > 1 and sorted(last) == list(range(QUESTIONS))
  assert set(last.values()) == {8}, last


def test_a_margin_ends_the_widening_at_its_last_span():
  rows = np.array([4, 4, 2, 2])
  scores = np.array([9.0, 8.5, 8.0, 5.0], np.float32)
  assert rereading.wants_wider(rows, 3, scores)  # two passages of three
  assert not rereading.wants_wider(rows, 2, scores)
  assert rereading.wants_wider(rows, 3, scores, 5.0)  # all four within 5 of the best
  assert not rereading.wants_wider(rows, 3, scores, 3.0)  # the last is 4 below: no more to read
  assert not rereading.wants_wider(rows[:0], 3, scores[:0])


def test_the_cache_keeps_at_most_its_tokens(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  sizes = flat.passage_end - flat.passage_start
  reader = _rereader(model, flat, cache_tokens=int(sizes[:3].sum()))
  reader.read([0, 1, 2], flat.dump.passages)
  reader.read([3], flat.dump.passages)  # passage 0, the least recently read, goes first
  assert (0, None) not in reader._cache and (3, None) in reader._cache
  assert reader._cached <= reader.cache_tokens
  reader.read([3], flat.dump.passages)
  assert reader.encoded_passages == 4


def test_rerank_places_the_re_read_spans_on_the_searchs_scale():
  ranked = (np.array([10, 40, 12, 50]), np.array([11, 41, 13, 52]),
            np.array([9.0, 8.0, 7.0, 6.0], np.float32))
  passages = np.array([1, 4, 1, 5])  # spans 10 and 12 of passage 1, re-read below
  read = (np.array([100, 103]), np.array([101, 104]), np.array([3.0, 5.0], np.float32))
  starts, ends, scores = rereading.rerank(ranked, passages, np.array([1]), read)
  assert starts.tolist() == [103, 40, 100, 50]
  np.testing.assert_allclose(scores, [9.0, 8.0, 7.0, 6.0])
  assert rereading.top_passages(np.array([4, 4, 2, 9, 2, 7]), 3).tolist() == [4, 2, 9]


def test_a_margin_re_reads_the_passages_of_the_spans_near_the_best():
  rows = np.array([4, 4, 2, 9, 2, 7])
  scores = np.array([9.0, 8.5, 8.0, 5.0, 4.0, 3.0], np.float32)
  for margin, expected in [(0.0, []), (0.5, []), (0.6, [4]), (1.0, [4]), (1.5, [4, 2]),
                           (4.5, [4, 2, 9]), (1e9, [4, 2, 9])]:
    assert rereading.top_passages(rows, 3, scores, margin).tolist() == expected, margin
  # a clear lead re-reads nothing, even when the next span is of the same passage
  assert rereading.top_passages(rows, 3, scores + np.array([2, 0, 0, 0, 0, 0]), 1.0).size == 0
  assert rereading.top_passages(rows[:1], 3, scores[:1], 5.0).size == 0  # one span: no rival
  assert rereading.top_passages(rows[:0], 3, scores[:0], 5.0).size == 0


def test_a_margin_of_zero_reads_nothing_and_a_wide_one_reads_as_without_it(workdir, model):
  flat, compact = PhraseIndex(workdir / "dump", "Flat"), PhraseIndex(workdir / "dump",
                                                                     "compact:PQ3")
  q_start, q_end = phrase_questions(flat.dump.vectors, QUESTIONS, 5)
  never = _rereader(model, compact, 3, margin=0.0)
  assert _top1(compact.with_options(reread=never), q_start, q_end) == _top1(compact, q_start,
                                                                             q_end)
  assert never.encoded_passages == 0
  wide, always = _rereader(model, compact, 3, margin=1e9), _rereader(model, compact, 3)
  assert (_top1(compact.with_options(reread=wide), q_start, q_end)
          == _top1(compact.with_options(reread=always), q_start, q_end))
  assert wide.encoded_passages == always.encoded_passages > 0
  some = _rereader(model, compact, 3, margin=0.05)
  compact.with_options(reread=some).search(q_start, q_end, 5)
  assert 0 < some.encoded_passages < always.encoded_passages


def test_re_reading_refuses_another_model_and_a_count_below_one(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  tokenizer = Tokenizer.from_pretrained(flat.dump.manifest["model"]["tokenizer"])
  with pytest.raises(ValueError, match=r"index.reread .* must be >= 1"):
    Rereader(model, tokenizer, flat.dump.manifest, 0)
  other = dict(flat.dump.manifest, fingerprint="0" * 16)
  with pytest.raises(DumpError, match="the model that made the dump"):
    Rereader(model, tokenizer, other, 2)
  with pytest.raises(TypeError, match="reread must be"):
    flat.with_options(reread=2)
  with pytest.raises(ValueError, match="index.reread"):
    PhraseSearcher(model, flat, tokenizer, reread=-1)
  with pytest.raises(ValueError, match="reread_margin without reread"):
    PhraseSearcher(model, flat, tokenizer, reread_margin=2.0)
  for margin in (-1.0, float("nan"), "2"):
    with pytest.raises(ValueError, match=r"index.reread_margin = .*: must be a number >= 0"):
      Rereader(model, tokenizer, flat.dump.manifest, 2, margin=margin)


def test_a_second_question_encoder_scores_the_re_read_spans(workdir, model):
  """Candidates ranked by one question's vectors, re-read spans scored by another's (a
  re-reader's own `questions` encoder): every passage read gives the second's answers, one
  passage read is the first's top one, scored by the second."""
  compact = PhraseIndex(workdir / "dump", "compact:PQ3")
  vectors = PhraseIndex(workdir / "dump", "Flat").dump.vectors
  ranking, scoring = (phrase_questions(vectors, QUESTIONS, seed) for seed in (5, 9))
  texts = [f"question {i}" for i in range(QUESTIONS)]

  def found(passages, vectors, own=None):
    reader = _rereader(model, compact, passages,
                       questions=None if own is None else lambda asked: own)
    # (every passage: every token a hit, so that every passage holds ranked spans)
    wide = 2 * compact.num_vectors if passages > 1 else None
    return [[(p.passage, p.start_char, p.end_char) for p, _ in units]
            for units in compact.with_options(reread=reader).search(*vectors, 3, texts=texts,
                                                                     top_tokens=wide)]

  every = compact.dump.manifest["num_passages"]
  both = found(every, ranking, scoring)
  assert both == found(every, scoring) != found(every, ranking)
  one = found(1, ranking, scoring)
  assert [a[0][0] for a in one] == [a[0][0] for a in found(1, ranking)]
  assert [a[0] for a in one] != [a[0] for a in found(1, ranking)]  # scored by the second
  reader = _rereader(model, compact, 2, questions=lambda asked: scoring)
  with pytest.raises(ValueError, match="needs the text of every question"):
    compact.with_options(reread=reader).search(*ranking, 3)


def test_a_searcher_scores_re_read_spans_with_its_reread_model(workdir, model):
  """`PhraseSearcher(reread_model=)`: its question encoder gives the re-read spans' vectors,
  `model`'s the search's; refused without re-reading or with another phrase encoder."""
  s = load_settings(CONFIG, [])
  other = model_for_data(s.model, s.data)  # untrained question encoders, the trained phrases
  for part in ("phrase_encoder", "filter_head"):
    nnx.update(getattr(other, part), nnx.state(getattr(model, part)))
  flat = PhraseIndex(workdir / "dump", "Flat")
  tokenizer = Tokenizer.from_pretrained(flat.dump.manifest["model"]["tokenizer"])
  texts = [q.question for q in open_workdir(CONFIG, workdir)[3][:8]]
  searcher = PhraseSearcher(model, flat, tokenizer, reread=2, reread_model=other)
  mine = searcher.encode(texts)
  theirs = PhraseSearcher(other, flat, tokenizer).encode(texts)
  scored = searcher.index.reread.question_vectors(texts, *mine)
  for a, b, c in zip(scored, theirs, mine):
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
  assert searcher.index.reread.question_vectors(texts, *mine) is scored  # (kept for the next)
  assert PhraseSearcher(model, flat, tokenizer, reread=2).index.reread.question_vectors(
      texts, *mine) == mine
  assert searcher.compile(4) > PhraseSearcher(model, flat, tokenizer, reread=2).compile(4)
  with pytest.raises(ValueError, match="reread_model without reread"):
    PhraseSearcher(model, flat, tokenizer, reread_model=other)
  stranger = model_for_data(s.model, s.data)  # another phrase encoder: not the dump's
  with pytest.raises(DumpError, match="the model that made the dump"):
    PhraseSearcher(model, flat, tokenizer, reread=2, reread_model=stranger)


def test_eval_re_reads_and_names_its_report(workdir):
  base = ["--config", CONFIG, "--workdir", str(workdir), "--set",
          "index.search_index=compact_PQ3", "--set", "eval.throughput_questions=64"]
  assert run.main(["eval"] + base + ["--set", "index.reread=2"]) == 0
  assert run.main(["eval"] + base) == 0
  reread = json.loads((workdir / "open_eval_compact_PQ3_reread2.json").read_text())
  coded = json.loads((workdir / "open_eval_compact_PQ3.json").read_text())
  assert reread["reread"] == 2 and coded["reread"] == 0
  assert reread["questions"] == coded["questions"] > 0
  # the same top passages, the first two reordered by their exact spans
  assert reread["top20"] == coded["top20"]
  # a margin of 0 re-reads no question: the codes' answers
  assert run.main(["eval"] + base + ["--set", "index.reread=2", "--set",
                                     "index.reread_margin=0"]) == 0
  never = json.loads((workdir / "open_eval_compact_PQ3_reread2_m0.json").read_text())
  assert never["reread_margin"] == 0.0 and reread["reread_margin"] is None
  assert {k: never[k] for k in ("em@1", "top1", "top20")} == {
      k: coded[k] for k in ("em@1", "top1", "top20")}


def test_a_searcher_compiles_re_readings_calls_ahead(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  tokenizer = Tokenizer.from_pretrained(flat.dump.manifest["model"]["tokenizer"])
  plain = PhraseSearcher(model, flat, tokenizer).compile(4)
  searcher = PhraseSearcher(model, flat, tokenizer, reread=2)
  assert searcher.compile(4) == plain + searcher.index.reread.compile() > plain


def test_re_reading_an_index_without_tokens_finds_nothing(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  empty = PhraseIndex.over_passages(flat.dump, []).with_options(reread=_rereader(model, flat))
  q_start, q_end = phrase_questions(flat.dump.vectors, 5, 2)
  for unit in ("phrase", "passage"):
    assert empty.search(q_start, q_end, 3, unit) == [[] for _ in q_start]


def test_the_service_re_reads_as_the_searcher_does(workdir):
  import http.client

  from dpjax.config import load_config
  from dpjax.main import open_searcher
  from dpjax.main.serve import service
  from dpjax.serve import start_server
  from dpjax.settings import Settings
  sets = ["index.search_index=compact_PQ3", "index.reread=2", "serve.max_batch=4",
          "serve.api_key_env="]
  settings = Settings.of(load_config(CONFIG, sets))
  searcher, _ = open_searcher(settings, workdir)
  question = "who won the game?"
  direct = searcher.search([question], k=3, max_answer_length=settings.eval.max_answer_length)[0]
  app, batcher = service(settings, workdir)
  server, thread, port = start_server(app)
  try:
    def get(path):
      connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
      connection.request("GET", path)
      return json.loads(connection.getresponse().read())
    assert get("/info")["reread"] == 2 and get("/info")["reread_margin"] is None
    served = get("/search?q=who+won+the+game%3F&k=3")["results"]
    assert [(r["passage_id"], r["start_char"], r["end_char"]) for r in served] == [
        (r["passage_id"], r["start_char"], r["end_char"]) for r in direct]
  finally:
    server.should_exit = True
    thread.join()
    batcher.stop()


def test_hybrid_re_reading_of_an_exact_index_keeps_its_answers(workdir, model):
  from dpjax.index.hybrid import Hybrid
  from dpjax.index.sparse import SparseIndex
  assert run.main(["index", "--config", CONFIG, "--workdir", str(workdir), "--set",
                   "index.specs=[]", "--set", "index.sparse=True", "--set",
                   "index.sparse_weight=1", "--set", "index.sparse_sentence_weight=0.5"]) == 0
  flat = PhraseIndex(workdir / "dump", "Flat")
  flat = flat.with_options(hybrid=Hybrid.recorded(SparseIndex(flat.dump.directory,
                                                              flat.dump.manifest)))
  tokenizer = Tokenizer.from_pretrained(flat.dump.manifest["model"]["tokenizer"])
  texts = [f"who is {p.title}?" for p in flat.dump.passages[:QUESTIONS:3]]
  q_start, q_end = PhraseSearcher(model, flat, tokenizer).encode(texts)
  theirs = [[(p.passage, p.start_char, p.end_char, p.score) for p, _ in units]
            for units in flat.search(q_start, q_end, 1, texts=texts)]
  reread = flat.with_options(reread=_rereader(model, flat))
  ours = [[(p.passage, p.start_char, p.end_char, p.score) for p, _ in units]
          for units in reread.search(q_start, q_end, 1, texts=texts)]
  assert [a[0][:3] for a in ours] == [a[0][:3] for a in theirs]
  np.testing.assert_allclose([a[0][3] for a in ours], [a[0][3] for a in theirs], rtol=1e-6)


def test_a_window_holds_its_span_and_cuts_between_words():
  tokenizer = Tokenizer.from_pretrained()
  text = ("The Normans were the people who in the 10th and 11th centuries gave their name to "
          "Normandy, a region in France. They descended from Norse raiders and pirates from "
          "Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear fealty.")
  pieces = tokenizer.tokenize([text])[0]
  assert rereading.window_of(tokenizer, text, 4, 11, len(pieces[0])) is None  # short enough
  for word in ("Normans", "Normandy", "Rollo", "fealty"):
    first = text.index(word)
    lo, hi = rereading.window_of(tokenizer, text, first, first + len(word), 16)
    assert lo <= first and first + len(word) <= hi
    inside = (pieces[1][:, 0] >= lo) & (pieces[1][:, 1] <= hi)
    assert inside.sum() <= 16
    part = tokenizer.tokenize([text[lo:hi]])[0]  # the part's pieces are the whole text's
    np.testing.assert_array_equal(part[0], pieces[0][inside])
    np.testing.assert_array_equal(part[1] + lo, pieces[1][inside])
  with pytest.raises(ValueError, match="index.reread_window"):
    Rereader(None, tokenizer, {}, 1, window=0)


def test_windowed_re_reading_reads_the_tokens_of_its_window(workdir, model):
  flat = PhraseIndex(workdir / "dump", "Flat")
  sizes = flat.passage_end - flat.passage_start
  window = int(np.median(sizes)) // 2
  reader = _rereader(model, flat, 2, window=window)
  rows = np.flatnonzero(sizes > window)[:4]
  middle = flat.dump.char_spans[flat.passage_start[rows] + sizes[rows] // 2]
  cuts = reader.windows([flat.dump.passages[r].text for r in rows], middle)
  read = reader.read(list(zip(rows, cuts)), flat.dump.passages)
  assert reader.encoded_tokens == sum(len(spans) for _, spans in read)
  for row, cut, (_, spans) in zip(rows, cuts, read):
    dumped = flat.dump.char_spans[flat.passage_start[row]:flat.passage_end[row]]
    inside = dumped[(dumped[:, 0] >= cut[0]) & (dumped[:, 1] <= cut[1])]
    np.testing.assert_array_equal(spans, inside)  # the window's tokens, by character
    assert 0 < len(spans) <= window
  assert reader.encoded_passages == len(rows)

  # A search's picked passages are read around their best spans: a top phrase in a passage
  # read through a window lies in it (its re-read spans replace the passage's).
  q_start, q_end = phrase_questions(flat.dump.vectors, QUESTIONS, 7)
  picked = []
  read_spans = rereading.read_spans
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(rereading, "read_spans", lambda *args, **kwargs: picked.append(
        (args[4], kwargs["cuts"])) or read_spans(*args, **kwargs))
    found = flat.with_options(reread=reader).search(q_start, q_end, 1)
  (picks, cuts), = picked
  assert any(c is not None for cut in cuts for c in cut)
  windowed = 0
  for ((phrase, _),), pick, cut in zip(found, picks, cuts):
    window_of = {int(r): c for r, c in zip(pick, cut)}
    if window_of.get(phrase.passage) is not None:
      lo, hi = window_of[phrase.passage]
      assert lo <= phrase.start_char and phrase.end_char <= hi
      windowed += 1
  assert windowed
