"""The DensePhrases dual encoder: three encoders from one checkpoint, or shared query encoders."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpjax.models import BertConfig, DensePhrases, load_dense_phrases
from dpjax.models.densephrases import compute_dtype, with_compute_dtype
from dpjax.models.encoders import _flat_encoder, bound, computing_leaves, question_vectors

TINY = BertConfig(vocab_size=31, hidden_size=15, num_hidden_layers=2, num_attention_heads=3,
                  intermediate_size=23, max_position_embeddings=19)


def _num_params(module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


@pytest.fixture(scope="module")
def model():
  return load_dense_phrases("minilm-l6")


def test_all_encoders_start_from_the_checkpoint(model):
  phrase = nnx.state(model.phrase_encoder, nnx.Param)
  for encoder in (model.query_start_encoder, model.query_end_encoder):
    assert encoder is not model.phrase_encoder
    jax.tree.map(np.testing.assert_array_equal, phrase, nnx.state(encoder, nnx.Param))
  assert model.query_start_encoder is not model.query_end_encoder
  assert float(jnp.abs(model.filter_head.kernel[...]).max()) == 0.0


def test_outputs(model, tokenizer):
  ids, mask = tokenizer.encode(["Who wrote Hamlet?", "When was it written?"], 11)
  passages, pmask = tokenizer.encode(["Hamlet was written by William Shakespeare."] * 2, 17)
  h = model.encode_phrases(jnp.asarray(passages), jnp.asarray(pmask))
  q_start, q_end = model.encode_questions(jnp.asarray(ids), jnp.asarray(mask))
  assert h.shape == (2, 17, 384) and h.dtype == jnp.float32
  assert q_start.shape == q_end.shape == (2, 384)
  # Start and end encoders are identical copies at initialisation, so their vectors agree.
  np.testing.assert_allclose(q_start, q_end, atol=1e-6)
  # q vectors are the [CLS] position of the question encoder.
  cls = model.query_start_encoder(jnp.asarray(ids), jnp.asarray(mask))[:, 0]
  np.testing.assert_allclose(q_start, cls, atol=1e-6)
  assert model.filter_logits(h).shape == (2, 17, 2)


def test_shared_query_encoders():
  separate = DensePhrases(TINY, rngs=nnx.Rngs(0))
  shared = DensePhrases(TINY, share_query_encoders=True, rngs=nnx.Rngs(0))
  encoder = _num_params(separate.phrase_encoder)
  assert _num_params(separate) - _num_params(shared) == encoder
  assert shared.query_start_encoder is shared.query_end_encoder
  ids = jnp.array([[1, 5, 7, 2]])
  q_start, q_end = shared.encode_questions(ids, jnp.ones_like(ids))
  np.testing.assert_array_equal(q_start, q_end)


def test_compute_dtype_shares_parameters_and_builds_its_graph_once(monkeypatch):
  """`with_compute_dtype`: the model's own parameters computing in bfloat16, the same as a model
  built in bfloat16 with them; the bfloat16 graph is built once (a second call traces nothing)."""
  for share in (False, True):
    model = DensePhrases(TINY, share_query_encoders=share, rngs=nnx.Rngs(0))
    assert with_compute_dtype(model, "float32") is model
    first = with_compute_dtype(model, "bfloat16")
    built = DensePhrases(TINY, share_query_encoders=share, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(built, nnx.state(model))
    ids = jnp.array([[1, 5, 7, 2, 0]])
    mask = (ids > 0).astype(jnp.int32)
    np.testing.assert_array_equal(first.encode_phrases(ids, mask), built.encode_phrases(ids, mask))
    with monkeypatch.context() as patch:
      patch.setattr(nnx, "eval_shape", lambda *a, **k: pytest.fail("graph built again"))
      again = with_compute_dtype(model, "bfloat16")
    assert compute_dtype(again) == "bfloat16" and compute_dtype(model) == "float32"
    assert nnx.graphdef(again) == nnx.graphdef(first)
    assert (again.query_start_encoder is again.query_end_encoder) == share
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b),
                 nnx.state(again, nnx.Param), nnx.state(model, nnx.Param))


def test_a_bound_bfloat16_encoder_casts_its_dense_parameters_once_to_the_same_outputs():
  """`bound` gives a bfloat16 encoder of float32 parameters its dense layers' kernels and biases
  in bfloat16 (the LayerNorms' and embeddings' stay float32): every output bit for bit what the
  layers casting them at each call give, the model's own parameters untouched."""
  model = with_compute_dtype(DensePhrases(TINY, rngs=nnx.Rngs(3)), "bfloat16")
  ids = jnp.array([[1, 5, 7, 2, 0], [3, 4, 0, 0, 0]])
  mask = (ids > 0).astype(jnp.int32)
  graphdef, state = nnx.split(model)
  leaves, treedef = computing_leaves(model, state)
  kinds = {}
  for (path, leaf), plain in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                 jax.tree.leaves(state)):
    kinds.setdefault(str(leaf.dtype) if plain.dtype == jnp.float32 else "other", set()).add(
        str(path[-2]))
  assert kinds["float32"] >= {"['scale']", "['embedding']"}
  assert {str(x.dtype) for x in leaves} >= {"bfloat16", "float32"}
  cast = [name for (path, _), new in zip(jax.tree_util.tree_flatten_with_path(state)[0], leaves)
          if new.dtype == jnp.bfloat16 for name in [str(path[-2])]]
  assert set(cast) == {"['kernel']", "['bias']"}
  uncast = _flat_encoder(graphdef, treedef, "phrases")(tuple(jax.tree.leaves(state)), ids, mask)
  np.testing.assert_array_equal(bound(model, "phrases")(ids, mask), uncast)
  assert {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {"float32"}
  float32 = DensePhrases(TINY, rngs=nnx.Rngs(3))
  assert len(computing_leaves(float32, nnx.state(float32))[0]) == len(jax.tree.leaves(
      nnx.state(float32)))
  assert all(x.dtype != jnp.bfloat16 for x in computing_leaves(float32, nnx.state(float32))[0])


def test_question_vectors_in_packed_rows(model, tokenizer):
  """On a CPU mesh, questions are packed several to a row (at most 8, rows of 64 tokens), in
  calls of at most 16 rows cut to 8-multiples, longest rows first; every vector equals the
  question's own in a padded batch (one question a row), in its place."""
  from dpjax.models.encoders import (PACKED_QUESTIONS, QuestionEncoders, bound, question_calls,
                                     question_vectors)
  from dpjax.parallel import make_mesh
  mesh = make_mesh()
  words = ["what", "year", "did", "the", "french", "army", "reach", "moscow"]
  rng = np.random.default_rng(0)
  questions = [" ".join(rng.choice(words, n)) + "?" for n in rng.integers(1, 30, 40)]
  ids, mask = tokenizer.encode(questions, 32)
  calls = []
  packed = bound(model, "packed_questions")

  def recording(i, s, p):
    calls.append((i.shape, np.asarray(s)))
    return packed(i, s, p)

  encoders = QuestionEncoders(lambda i, m: pytest.fail("a CPU packs its questions"), recording)
  q_start, q_end = question_vectors(encoders, ids, mask, batch_size=64, mesh=mesh)
  rows, multiple = question_calls(64, mesh)
  assert (rows, multiple) == (max(16, mesh.size), 8) and all(c[0] <= rows for c, _ in calls)
  widths = [c[1] for c, _ in calls]
  assert widths == sorted(widths, reverse=True) and all(w % multiple == 0 for w in widths)
  tokens = int(mask.sum())
  assert sum(int((s > 0).sum()) for _, s in calls) == tokens  # every token once
  assert all(s.max() <= PACKED_QUESTIONS for _, s in calls)
  assert sum(c[0] for c, _ in calls) < len(questions) // 2  # several questions a row
  alone = model.encode_questions(jnp.asarray(ids), jnp.asarray(mask))
  np.testing.assert_allclose(q_start, alone[0], atol=2e-5)
  np.testing.assert_allclose(q_end, alone[1], atol=2e-5)
  assert np.ptp(q_start, axis=0).max() > 1e-3  # the questions' vectors differ
  mask[7] = 0
  with pytest.raises(ValueError, match="question 7 has no tokens"):
    question_vectors(encoders, ids, mask, batch_size=64, mesh=mesh)


def test_pack_rows_places_each_sequence_once_best_fit_longest_first():
  """`pack_rows`: no two sequences share a column, none passes the width or the row's count;
  the rows are as few as the tokens allow for sizes that tile them, and within 5% of that for
  random sizes; sizes out of 1..width are refused."""
  from dpjax.models.encoders import pack_rows
  rng = np.random.default_rng(1)
  for lengths, width, most in ((rng.integers(3, 33, 500), 64, 8), (np.full(40, 16), 64, 8),
                               (rng.integers(1, 9, 300), 64, 4), (np.array([64, 1, 63]), 64, 8)):
    row, offset, slot = pack_rows(lengths, width, most)
    taken = np.zeros((row.max() + 1, width), int)
    for r, o, n in zip(row, offset, lengths):
      assert o + n <= width
      taken[r, o:o + n] += 1
    assert taken.max() == 1
    assert len(set(zip(row, slot))) == len(lengths) and slot.max() < most
    assert np.bincount(row).max() <= most
    least = max(-(-lengths.sum() // width), -(-len(lengths) // most))
    assert row.max() + 1 <= 1.05 * least + 1, (row.max() + 1, least)  # next fit: 164 vs 140
    if (lengths == 16).all():
      assert row.max() + 1 == least
  with pytest.raises(ValueError, match="1..64"):
    pack_rows(np.array([65]), 64, 8)


def test_compiled_question_shapes_cover_every_call(tokenizer):
  """`compile_questions` compiles every shape `question_vectors` then calls the encoder with, for
  any number of questions (up to its bound) of any length: the calls compile nothing. On a CPU
  the packed encoder's rows (powers of two) x widths (8-multiples up to 64); on an accelerator
  the padded encoder's, 16-multiples up to the longest question. (A model of shapes no other
  test compiles.)"""
  from dpjax.models.encoders import bound_questions, compile_questions, question_call_shapes
  from dpjax.parallel import compile_stats, make_mesh
  config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=37, max_position_embeddings=64)
  tiny = DensePhrases(config, rngs=nnx.Rngs(0))
  mesh = make_mesh(1)
  assert question_call_shapes(64, mesh, 32) == ([1, 2, 4, 8, 16], list(range(8, 65, 8)))
  assert question_call_shapes(64, mesh, 72, max_questions=3) == ([1, 2, 4],
                                                                  list(range(8, 73, 8)))
  encoders = bound_questions(tiny)
  assert compile_questions(encoders, 64, mesh, 20, max_questions=3) == 3 * 8
  before = compile_stats()["count"]
  rng = np.random.default_rng(0)
  words = ["what", "year", "did", "the", "french", "army", "reach", "moscow"]
  for _ in range(20):
    texts = [" ".join(rng.choice(words, n)) for n in rng.integers(1, 30, rng.integers(1, 4))]
    ids, mask = tokenizer.encode(texts, 20)
    question_vectors(encoders, ids, mask, batch_size=64, mesh=mesh)
  assert compile_stats()["count"] == before

  class Device:
    platform = "gpu"

  class Mesh:
    devices, size = np.array([Device()]), 1
  assert question_call_shapes(64, Mesh(), 40) == ([1, 2, 4, 8, 16, 32, 64], [16, 32, 40])


def test_phrase_calls_on_a_cpu_and_an_accelerator(monkeypatch):
  """Windows go to the phrase encoder in calls of at most 16 rows (a multiple of the devices)
  cut to 16-multiples on a CPU mesh; an accelerator's calls take the whole batch, 32-multiples."""
  from dpjax.models import encoders
  from dpjax.parallel import make_mesh
  mesh = make_mesh()
  assert encoders.phrase_calls(64, mesh) == (max(16, mesh.size), 16)
  assert encoders.phrase_calls(8, mesh)[0] == 8

  class Device:
    platform = "gpu"

  class Mesh:
    devices = np.array([Device()])
  assert encoders.phrase_calls(64, Mesh()) == (64, 32)
