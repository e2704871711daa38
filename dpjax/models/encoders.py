"""The jitted encoders of a DensePhrases model and the one batched-encoding helper.

Everything that encodes many passages or questions (RC evaluation, search, the dump, the token
filter, validation) goes through `phrase_batches` / `question_vectors`: length-bucketed batches
sharded over the mesh, padding dropped, each result put back at its rows.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpjax.parallel import batch_sharding, make_mesh, map_batches, round_to_devices

# Questions are sorted by length and each encoder call is cut to its rows' longest question,
# rounded up to a multiple of a few tokens. On a CPU, where compute is per token, the calls take
# at most CPU_QUESTION_CHUNK rows at multiples of CPU_QUESTION_WIDTH, so that short questions are
# not padded to the longest of a big batch: 64 SQuAD questions (max_query_length 32) in 0.95 s
# instead of 1.56 s on 2 cores. An accelerator takes the whole batch in one call at multiples of
# QUESTION_WIDTH (per-call latency dominates there; fewer shapes to compile).
QUESTION_WIDTH = 16
CPU_QUESTION_WIDTH = 8
CPU_QUESTION_CHUNK = 16
# Passage windows likewise (the dump, RC evaluation, the token filter): on a CPU at most
# CPU_PHRASE_CHUNK rows per call at multiples of CPU_PHRASE_WIDTH: the phrase encoder's forward
# at 16 x 192 runs 1.2x the tokens/s of 64 x 192 (the 2-core Xeon, float32: 8.9k vs 7.5k), and
# the dump's windows of SQuAD dev's first 600 passages (192 tokens) take 1.21x their real tokens
# in such calls instead of 1.36x in 64-row batches cut to 32-multiples. Accelerators keep the
# batch size and multiples of PHRASE_WIDTH.
PHRASE_WIDTH = 32
CPU_PHRASE_WIDTH = 16
CPU_PHRASE_CHUNK = 16


class Encoders(NamedTuple):
  """Jitted encoders `fn(state, input_ids, attention_mask)` of one model graph."""
  phrases: Callable  # -> h [B, L, D]
  questions: Callable  # -> (q_start, q_end) [B, D] each
  phrases_and_filter: Callable  # -> (h [B, L, D], filter logits [B, L, 2]), float16 (dumped)


@functools.lru_cache(maxsize=8)
def make_encoders(graphdef: nnx.GraphDef) -> Encoders:
  """Jitted phrase and question encoders taking the model state as an argument.

  Cached per graph definition, so evaluating every N steps of training compiles once.
  """

  @jax.jit
  def phrases(state, input_ids, attention_mask):
    return nnx.merge(graphdef, state).encode_phrases(input_ids, attention_mask)

  @jax.jit
  def questions(state, input_ids, attention_mask):
    return nnx.merge(graphdef, state).encode_questions(input_ids, attention_mask)

  @jax.jit
  def phrases_and_filter(state, input_ids, attention_mask):
    model = nnx.merge(graphdef, state)
    h = model.encode_phrases(input_ids, attention_mask)
    # Cast on the device: half the bytes to copy back, no host conversion.
    return h.astype(jnp.float16), model.filter_logits(h).astype(jnp.float16)

  return Encoders(phrases, questions, phrases_and_filter)


def bound(model, encoder: str) -> Callable:
  """`fn(input_ids, attention_mask)` of one of the model's jitted `Encoders` (by field name).

  The model's state goes in as the tuple of its arrays, flattened once here: JAX flattens a
  tuple of arrays in C++ at every call, an `nnx.State` in Python (a call's host CPU 0.27 instead
  of 0.72 ms for DensePhrases-MiniLM, time of the thread that feeds the encoder)."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  return functools.partial(_flat_encoder(graphdef, treedef, encoder), tuple(leaves))


@functools.lru_cache(maxsize=8)
def _flat_encoder(graphdef: nnx.GraphDef, treedef, encoder: str) -> Callable:
  """`jit(fn(leaves, input_ids, attention_mask))`: an `Encoders` field on a flattened state."""
  jitted = getattr(make_encoders(graphdef), encoder)

  @jax.jit
  def flat(leaves, input_ids, attention_mask):
    return jitted(jax.tree.unflatten(treedef, leaves), input_ids, attention_mask)

  return flat


def phrase_calls(batch_size: int, mesh, width_multiple: int = 0) -> tuple[int, int]:
  """(rows per phrase-encoder call, the multiple its width is rounded up to): `batch_size` and
  PHRASE_WIDTH, or on a CPU mesh at most CPU_PHRASE_CHUNK rows (a multiple of the mesh size)
  and CPU_PHRASE_WIDTH; `width_multiple` (> 0) instead of either width."""
  rows, multiple = _calls(batch_size, mesh, (CPU_PHRASE_CHUNK, CPU_PHRASE_WIDTH), PHRASE_WIDTH)
  return rows, width_multiple or multiple


def _calls(batch_size: int, mesh, cpu: tuple[int, int], width: int) -> tuple[int, int]:
  """(rows per call, width multiple): `batch_size` and `width` on an accelerator; on a CPU mesh
  `cpu` = (at most that many rows, rounded to the mesh size; its width multiple)."""
  if mesh.devices.flat[0].platform != "cpu":
    return batch_size, width
  return min(batch_size, round_to_devices(cpu[0], mesh)), cpu[1]


def call_widths(multiple: int, max_length: int) -> list[int]:
  """Every width `map_batches` cuts a call of rows at most `max_length` long to (their longest
  row rounded up to `multiple`, at most the arrays' own width)."""
  return sorted({min(k * multiple, max_length) for k in range(1, -(-max_length // multiple) + 1)})


def compile_ahead(encode: Callable, rows: int, widths: Sequence[int], mesh,
                  threads: int | None = None) -> int:
  """Compiles a `bound` encoder for int32 [rows, width] batches sharded over `mesh`, every width
  at once in `threads` threads (XLA compiles outside the GIL): the calls of a long job at those
  shapes (`map_batches` with `pad_last`) then compile nothing. The compiles contend (on an H200
  the SQuAD-open small dump's 12 widths: 36.6 s at once, 323 s of compile time; 11 widths one
  after the other as the calls came: 41.4 s; results/speed_gpu.md). Returns the shapes compiled."""
  flat, (leaves,) = encode.func, encode.args
  sharding = batch_sharding(mesh)

  def compile_width(width: int) -> None:
    spec = jax.ShapeDtypeStruct((rows, width), np.int32, sharding=sharding)
    flat.lower(leaves, spec, spec).compile()

  threads = max(1, min(len(widths), threads or os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(compile_width, widths))
  return len(widths)


def phrase_batches(encode: Callable, input_ids: np.ndarray, attention_mask: np.ndarray, *,
                   batch_size: int, mesh, width_multiple: int = 0,
                   **options) -> Iterator[tuple[np.ndarray, object]]:
  """(rows, outputs) of `encode` over windows [W, L] in length-bucketed calls of `phrase_calls`
  rows (and widths; `width_multiple` > 0: multiples of it); outputs are cut to the call's
  longest row (columns past it are padding). `options`: more `map_batches` arguments."""
  rows, multiple = phrase_calls(batch_size, mesh, width_multiple)
  return map_batches(encode, [input_ids, attention_mask], rows, mesh,
                     lengths=attention_mask.sum(1), length_multiple=multiple, **options)


def question_width_multiple(platform: str) -> int:
  """What question widths are rounded up to on a platform ("cpu", "gpu", "tpu"): training
  batches (`dpjax.data.batches.trim_questions`) and encoder calls alike."""
  return CPU_QUESTION_WIDTH if platform == "cpu" else QUESTION_WIDTH


def question_calls(batch_size: int, mesh) -> tuple[int, int]:
  """(rows per question-encoder call, the multiple its width is rounded up to): `batch_size` and
  QUESTION_WIDTH, or on a CPU mesh at most CPU_QUESTION_CHUNK rows (a multiple of the mesh size)
  and CPU_QUESTION_WIDTH."""
  return _calls(batch_size, mesh, (CPU_QUESTION_CHUNK, CPU_QUESTION_WIDTH), QUESTION_WIDTH)


def question_vectors(encode: Callable, input_ids: np.ndarray, attention_mask: np.ndarray, *,
                     batch_size: int, mesh) -> tuple[np.ndarray, np.ndarray]:
  """(q_start, q_end) [Q, D] of tokenised questions by `encode` (a bound question encoder), in
  calls of `question_calls` rows sorted by length, each cut to its own width."""
  q_start = q_end = None
  rows_per_call, width = question_calls(batch_size, mesh)
  for rows, (qs, qe) in map_batches(encode, [input_ids, attention_mask], rows_per_call, mesh,
                                    lengths=attention_mask.sum(1), length_multiple=width):
    if q_start is None:
      q_start = np.zeros((len(input_ids), qs.shape[1]), qs.dtype)
      q_end = np.zeros_like(q_start)
    q_start[rows], q_end[rows] = qs, qe
  if q_start is None:
    raise ValueError("no questions to encode")
  return q_start, q_end


def encode_questions(model, tokenizer, questions: Sequence[str], *, max_query_length: int = 64,
                     batch_size: int = 64, mesh=None) -> tuple[np.ndarray, np.ndarray]:
  """(q_start, q_end) [Q, D] of question texts by the model's question encoders."""
  mesh = mesh or make_mesh()
  ids, mask = tokenizer.encode(list(questions), max_query_length)
  return question_vectors(bound(model, "questions"), ids, mask,
                          batch_size=round_to_devices(batch_size, mesh), mesh=mesh)
