"""The DensePhrases dual encoder: three encoders from one checkpoint, or shared query encoders."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpjax.models import BertConfig, DensePhrases, load_dense_phrases

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


def test_question_vectors_in_length_sorted_chunks(model, tokenizer):
  """On a CPU mesh, questions are encoded in calls of at most 16 rows sorted by length, each cut
  to its own width; every vector equals the question encoded alone, unpadded, in its place."""
  from dpjax.models.encoders import bound, question_calls, question_vectors
  from dpjax.parallel import make_mesh
  mesh = make_mesh()
  words = ["what", "year", "did", "the", "french", "army", "reach", "moscow"]
  rng = np.random.default_rng(0)
  questions = [" ".join(rng.choice(words, n)) + "?" for n in rng.integers(1, 30, 40)]
  ids, mask = tokenizer.encode(questions, 32)
  calls = []
  encode = bound(model, "questions")

  def recording(i, m):
    calls.append(i.shape)
    return encode(i, m)

  q_start, q_end = question_vectors(recording, ids, mask, batch_size=64, mesh=mesh)
  rows, multiple = question_calls(64, mesh)
  assert (rows, multiple) == (16, 8) and len(calls) == 3 and all(c[0] <= rows for c in calls)
  widths = [c[1] for c in calls]
  assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0]
  assert all(w % multiple == 0 or w == 32 for w in widths)
  for n in (0, 17, 39):
    length = int(mask[n].sum())
    alone = model.encode_questions(jnp.asarray(ids[n:n + 1, :length]),
                                   jnp.asarray(mask[n:n + 1, :length]))
    np.testing.assert_allclose(q_start[n], alone[0][0], atol=2e-5)
    np.testing.assert_allclose(q_end[n], alone[1][0], atol=2e-5)


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
