"""experiments/benchmarks/codec_scores.py's measures, on random vectors."""
import numpy as np
import pytest
from conftest import load_script

scores = load_script("experiments/benchmarks/codec_scores.py")


def _data(seed=0):
  rng = np.random.default_rng(seed)
  tokens = (rng.standard_normal((3000, 16)) + 4.0).astype(np.float32)  # a large mean vector
  queries = rng.standard_normal((60, 16)).astype(np.float32)
  return rng, tokens, queries


def test_exact_codes_agree_fully_and_noise_lowers_agreement():
  rng, tokens, queries = _data()
  ids, values = scores.exact_top(queries, tokens, k=100)
  np.testing.assert_allclose(values[:, 0], (queries @ tokens.T).max(1), rtol=1e-6)
  same = scores.agreement(queries, tokens, ids, values)
  assert same["top1_at1"] == same["recall10_at100"] == 1.0
  assert same["rel_score_err"] == pytest.approx(0.0, abs=1e-5)
  noisy = tokens + 0.5 * rng.standard_normal(tokens.shape).astype(np.float32)
  worse = scores.agreement(queries, noisy, ids, values)
  assert worse["top1_at1"] < 1.0 and worse["recall10_at100"] < 1.0
  assert worse["rel_score_err"] > 0.1
  pq, _, _, size = scores.coded("PQ4", tokens[:2000], tokens)
  assert size == 4 and pq.shape == tokens.shape
  assert 0 < scores.agreement(queries, pq, ids, values)["top1_at1"] < 1.0


def test_question_weighting_keeps_every_score():
  rng, tokens, queries = _data(1)
  to_codes, to_queries = scores.question_weighting(rng.standard_normal((500, 16)) * np.arange(
      1, 17))
  np.testing.assert_allclose(to_queries(queries) @ to_codes(tokens).T, queries @ tokens.T,
                             rtol=1e-3, atol=1e-3)


def test_energy_finds_the_mean():
  _, tokens, queries = _data(2)
  e = scores.energy(tokens, queries, rows=2000)
  assert e["mean_share_of_energy"] == pytest.approx(256 / 272, abs=0.02)  # |mean|^2 / E|x|^2
  assert 0 < e["token_variance_top"][1] < e["token_variance_top"][10] <= 1.0


def test_passage_residuals_and_the_codec_grammar():
  rng = np.random.default_rng(3)
  passages = np.repeat(np.arange(4), [3, 1, 5, 2])
  tokens = rng.standard_normal((11, 8)).astype(np.float32) + 10 * passages[:, None]
  means = scores.passage_means(tokens, passages)
  for p in range(4):
    np.testing.assert_allclose(means[passages == p], np.broadcast_to(
        tokens[passages == p].mean(0), ((passages == p).sum(), 8)), rtol=1e-5)
  assert scores.parse_codec("OPQ24,PQ24") == (set(), "OPQ24,PQ24")
  assert scores.parse_codec("qw:PQ4") == ({"qw"}, "PQ4")
  assert scores.parse_codec("qw+pr:OPQ8,PQ8") == ({"qw", "pr"}, "OPQ8,PQ8")


def test_passage_recall_ranks_the_best_tokens_passage_by_its_mean():
  passages = np.array([0, 0, 1, 1, 2])
  tokens = np.array([[1, 0], [1, 0], [0, 1], [0, 3], [2, 2]], np.float32)  # means: e1, 2 e2, 2,2
  queries = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
  best = np.array([0, 3, 4])  # passages 0, 1, 2
  # query e1 ranks passage 0 (mean 1) second after passage 2 (2); e2 ranks passage 1 (2) first
  # with passage 2 (2) tied, not above it; (1, 1) ranks passage 2 (4) first.
  r = scores.passage_recall(queries, tokens, passages, best, depths=(1, 2))
  assert r == {"passages": 3, "1": 2 / 3, "2": 1.0}


def test_dense_scores_over_decoded_tokens_and_the_weighting_undone(tmp_path):
  import dataclasses
  import types

  from test_search import ANSWERS, PASSAGES, _toy_dump

  from dpjax.index.dump_reader import Dump
  q_start, q_end = _toy_dump(tmp_path)
  dump = Dump.load(tmp_path)
  answers = [[answer] for _, answer in ANSWERS]
  evaluation = types.SimpleNamespace(max_answer_length=10, regex=False)  # (EvalSettings' two)
  kept = np.arange(len(dump.vectors))
  queries = np.concatenate([q_start, q_end])
  exact = scores.search_scores(dump, kept, queries, answers, evaluation)
  assert exact["em@1"] == 100.0 and exact["top1"] == 100.0
  # Zeroed vectors rank nothing right: the figures come from the vectors given.
  blank = dataclasses.replace(dump, vectors=np.zeros(dump.vectors.shape, np.float32))
  assert scores.search_scores(blank, kept, queries, answers, evaluation)["em@1"] < 100.0
  rng = np.random.default_rng(4)
  train = rng.standard_normal((300, 8)) * np.arange(1, 9)
  to_codes, _ = scores.question_weighting(train)
  x = rng.standard_normal((5, 8)).astype(np.float32)
  np.testing.assert_allclose(scores.to_original(to_codes(x), train), x, rtol=1e-3, atol=1e-4)
