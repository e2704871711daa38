"""The jitted encoders of a DensePhrases model and the one batched-encoding helper.

Everything that encodes many passages or questions (RC evaluation, search, the dump, the token
filter, validation) goes through `phrase_batches` / `question_vectors`: length-bucketed batches
(on a CPU, questions packed several to a row) sharded over the mesh, padding dropped, each
result put back at its rows.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpjax.parallel import (batch_spec, call_shapes, call_widths, compile_at_once, make_mesh,
                            map_batches, padded_rows, round_to_devices)

# Questions are sorted by length and each encoder call is cut to its rows' longest question,
# rounded up to a multiple of a few tokens. On a CPU, where compute is per token, the calls take
# at most CPU_QUESTION_CHUNK rows at multiples of CPU_QUESTION_WIDTH, so that short questions are
# not padded to the longest of a big batch (results/code_measurements.md). An accelerator takes
# the whole batch in one call at multiples of QUESTION_WIDTH (per-call latency dominates there;
# fewer shapes to compile).
QUESTION_WIDTH = 16
CPU_QUESTION_WIDTH = 8
CPU_QUESTION_CHUNK = 16
# On a CPU the questions are also packed, several to a row of CPU_PACKED_WIDTH tokens (or the
# longest question's width) and at most PACKED_QUESTIONS a row, each attending to its own tokens
# only (`DensePhrases.encode_packed_questions`): compute goes to real tokens rather than padding,
# and the vectors equal the unpacked ones to float32 rounding (results/code_measurements.md).
CPU_PACKED_WIDTH = 64
PACKED_QUESTIONS = 8
# Passage windows likewise (the dump, RC evaluation, the token filter): on a CPU at most
# CPU_PHRASE_CHUNK rows per call at multiples of CPU_PHRASE_WIDTH: small calls run faster per
# token on a CPU and pad less (results/code_measurements.md). Accelerators keep the batch size
# and multiples of PHRASE_WIDTH.
PHRASE_WIDTH = 32
CPU_PHRASE_WIDTH = 16
CPU_PHRASE_CHUNK = 16


class Encoders(NamedTuple):
  """Jitted encoders `fn(state, input_ids, attention_mask)` of one model graph."""
  phrases: Callable  # -> h [B, L, D]
  questions: Callable  # -> (q_start, q_end) [B, D] each
  phrases_and_filter: Callable  # -> (h [B, L, D], filter logits [B, L, 2]), float16 (dumped)
  # fn(state, input_ids, segment_ids, position_ids) of packed rows -> (q_start, q_end)
  # [B, PACKED_QUESTIONS, D] each
  packed_questions: Callable


class QuestionEncoders(NamedTuple):
  """A model's two `bound` question encoders (`bound_questions`): `padded(input_ids,
  attention_mask)`, a question a row, and `packed(input_ids, segment_ids, position_ids)`."""
  padded: Callable
  packed: Callable


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

  @jax.jit
  def packed_questions(state, input_ids, segment_ids, position_ids):
    return nnx.merge(graphdef, state).encode_packed_questions(
        input_ids, segment_ids, position_ids, PACKED_QUESTIONS)

  return Encoders(phrases, questions, phrases_and_filter, packed_questions)


def bound(model, encoder: str) -> Callable:
  """`fn(input_ids, attention_mask)` of one of the model's jitted `Encoders` (by field name).

  The model's state goes in as the tuple of its arrays, flattened once here: JAX flattens a
  tuple of arrays in C++ at every call, an `nnx.State` in Python, which costs the thread that
  feeds the encoder time at every call (results/code_measurements.md). Dense layers computing in
  another dtype than their parameters' get theirs cast once here (`computing_leaves`)."""
  return _bound_all(model, encoder)[0]


def _bound_all(model, *encoders: str) -> list[Callable]:
  """`bound` of each of `encoders`, sharing one set of (cast) leaves."""
  graphdef, state = nnx.split(model)
  leaves, treedef = computing_leaves(model, state)
  return [functools.partial(_flat_encoder(graphdef, treedef, encoder), tuple(leaves))
          for encoder in encoders]


def computing_leaves(model, state) -> tuple[list, object]:
  """(the leaves, treedef) of the model's `state` with each dense layer's kernel and bias cast to
  the dtype the layer computes in (a bfloat16 encoder of float32 parameters): the layer casts
  them at every call to the same values, a share of a bfloat16 CPU encoder's call
  (results/code_measurements.md). The model's own variables are left as they are."""
  casts = {tuple(path): jnp.dtype(module.dtype) for path, module in nnx.iter_modules(model)
           if isinstance(module, nnx.Linear) and module.dtype is not None
           and jnp.dtype(module.dtype) != module.kernel[...].dtype}
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  leaves = []
  for path, leaf in flat:
    keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)
    dtype = casts.get(keys[:-2]) if keys[-2:-1] in (("kernel",), ("bias",)) else None
    leaves.append(leaf if dtype is None else leaf.astype(dtype))
  return leaves, treedef


def bound_questions(model) -> QuestionEncoders:
  """The model's question encoders, `bound` (what `question_vectors` takes)."""
  return QuestionEncoders(*_bound_all(model, "questions", "packed_questions"))


@functools.lru_cache(maxsize=8)
def _flat_encoder(graphdef: nnx.GraphDef, treedef, encoder: str) -> Callable:
  """`jit(fn(leaves, input_ids, attention_mask))`: an `Encoders` field on a flattened state."""
  jitted = getattr(make_encoders(graphdef), encoder)

  @jax.jit
  def flat(leaves, *arrays):
    return jitted(jax.tree.unflatten(treedef, leaves), *arrays)

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
  if not _on_cpu(mesh):
    return batch_size, width
  return min(batch_size, round_to_devices(cpu[0], mesh)), cpu[1]


def _on_cpu(mesh) -> bool:
  """Whether the mesh's devices are CPUs (encoder calls of a few rows, questions packed)."""
  return mesh.devices.flat[0].platform == "cpu"


def compile_ahead(encode: Callable, rows: int, widths: Sequence[int], mesh,
                  threads: int | None = None, inputs: int = 2) -> int:
  """Compiles a `bound` encoder for `inputs` int32 [rows, width] batches on `mesh` (as
  `map_batches` passes them: `batch_spec`), every width at once in `threads` threads (XLA
  compiles outside the GIL): the calls of a long job at those shapes (`map_batches` with
  `pad_last`) then compile nothing. The compiles contend, yet finish sooner together than one
  after the other as the calls come (results/speed_gpu.md). Returns the shapes compiled."""
  compiles = shape_compiles(encode, [(rows, width) for width in widths], mesh, inputs)
  return compile_at_once(lambda compile_one: compile_one(), compiles, threads)


def shape_compiles(encode: Callable, shapes: Sequence[tuple[int, int]], mesh,
                   inputs: int = 2) -> list[Callable[[], None]]:
  """A function per (rows, width) of `shapes` that compiles a `bound` encoder for `inputs` int32
  batches of that shape on `mesh`, as `map_batches` passes them (`batch_spec`): to run at once
  in threads (`compile_at_once`), with other compiles if need be."""
  flat, (leaves,) = encode.func, encode.args

  def compile_shape(shape: tuple[int, int]) -> None:
    spec = batch_spec(shape, np.int32, mesh)
    flat.lower(leaves, *[spec] * inputs).compile()

  return [functools.partial(compile_shape, tuple(shape)) for shape in shapes]


def phrase_compiles(encode: Callable, attention_mask: np.ndarray, *, batch_size: int, mesh,
                    width_multiple: int = 0) -> list[Callable[[], None]]:
  """`shape_compiles` of every call `phrase_batches` makes with these arguments."""
  rows, multiple = phrase_calls(batch_size, mesh, width_multiple)
  mask = np.asarray(attention_mask)
  shapes = call_shapes(mask.sum(1), mask.shape[1], rows, mesh, length_multiple=multiple)
  return shape_compiles(encode, shapes, mesh)


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


def question_vectors(encoders: QuestionEncoders, input_ids: np.ndarray,
                     attention_mask: np.ndarray, *, batch_size: int,
                     mesh) -> tuple[np.ndarray, np.ndarray]:
  """(q_start, q_end) [Q, D] of tokenised questions (`[CLS] ... [SEP]`, padding last) by a
  model's `bound_questions`: on an accelerator `padded` in calls of `batch_size` rows sorted by
  length, each cut to its own width; on a CPU `packed` in calls of `question_calls` rows of
  several questions each (`pack_rows`)."""
  if not len(input_ids):
    raise ValueError("no questions to encode")
  lengths = np.asarray(attention_mask).sum(1)
  if lengths.min() < 1:
    raise ValueError(f"question {int(np.argmin(lengths))} has no tokens (its attention_mask "
                     "is all 0): a question is at least `[CLS] [SEP]`")
  encode, arrays, lengths, questions, rows_per_call, multiple = _question_calls(
      encoders, input_ids, attention_mask, batch_size, mesh)
  q_start = q_end = None
  for rows, (qs, qe) in map_batches(encode, arrays, rows_per_call, mesh,
                                    lengths=lengths, length_multiple=multiple):
    if questions is not None:  # packed: [n, S, D] -> the rows' questions
      held = questions[rows] >= 0
      rows, qs, qe = questions[rows][held], qs[held], qe[held]
    if q_start is None:
      q_start = np.zeros((len(input_ids), qs.shape[-1]), qs.dtype)
      q_end = np.zeros_like(q_start)
    q_start[rows], q_end[rows] = qs, qe
  return q_start, q_end


def _question_calls(encoders: QuestionEncoders, input_ids: np.ndarray,
                    attention_mask: np.ndarray, batch_size: int, mesh) -> tuple:
  """How `question_vectors` calls an encoder for these questions: (the encoder, its input
  arrays, their rows' lengths, the question at each packed row's place (None: a question a
  row), rows per call, the width multiple)."""
  rows_per_call, multiple = question_calls(batch_size, mesh)
  lengths = np.asarray(attention_mask).sum(1)
  if not _on_cpu(mesh):
    return (encoders.padded, [input_ids, attention_mask], lengths, None, rows_per_call,
            multiple)
  arrays, lengths, questions = _packed_questions(input_ids, lengths,
                                                 _packed_width(int(lengths.max()), multiple))
  return encoders.packed, arrays, lengths, questions, rows_per_call, multiple


def question_compiles(encoders: QuestionEncoders, input_ids: np.ndarray,
                      attention_mask: np.ndarray, *, batch_size: int,
                      mesh) -> list[Callable[[], None]]:
  """`shape_compiles` of every call `question_vectors` makes with these arguments."""
  encode, arrays, lengths, _, rows, multiple = _question_calls(encoders, input_ids,
                                                               attention_mask, batch_size, mesh)
  shapes = call_shapes(lengths, arrays[0].shape[1], rows, mesh, length_multiple=multiple)
  return shape_compiles(encode, shapes, mesh, inputs=len(arrays))


def question_call_shapes(batch_size: int, mesh, max_query_length: int,
                         max_questions: int | None = None) -> tuple[list[int], list[int]]:
  """(row counts, widths): every [rows, width] shape of the encoder calls `question_vectors`
  makes for questions of at most `max_query_length` tokens (the tokenizer's truncation), at most
  `max_questions` at once (default: any number)."""
  rows_per_call, multiple = question_calls(batch_size, mesh)
  longest = max_query_length
  if _on_cpu(mesh):
    longest = _packed_width(max_query_length, multiple)
  calls = range(1, min(rows_per_call, max_questions or rows_per_call) + 1)  # rows of a call
  rows = sorted({padded_rows(n, rows_per_call, mesh) for n in calls})
  return rows, call_widths(multiple, longest)


def compile_questions(encoders: QuestionEncoders, batch_size: int, mesh, max_query_length: int,
                      max_questions: int | None = None) -> int:
  """Compiles the question encoder `question_vectors` calls for every shape it may call it
  with (`question_call_shapes`): then no call compiles (a service's). Returns the shapes."""
  rows, widths = question_call_shapes(batch_size, mesh, max_query_length, max_questions)
  encode, inputs = (encoders.packed, 3) if _on_cpu(mesh) else (encoders.padded, 2)
  return sum(compile_ahead(encode, n, widths, mesh, inputs=inputs) for n in rows)


def _packed_width(longest: int, multiple: int) -> int:
  """The rows questions of at most `longest` tokens are packed into: CPU_PACKED_WIDTH, or
  `longest` rounded up to `multiple` if that is more."""
  return max(CPU_PACKED_WIDTH, -(-longest // multiple) * multiple)


def pack_rows(lengths: np.ndarray, width: int,
              max_per_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Sequences of `lengths` (each at most `width`) packed into rows of `width`, at most
  `max_per_row` a row: best fit, longest first (each goes to the fullest row it fits).
  Returns (row, offset, slot) [N]: its row, its first column there, its place among the row's."""
  lengths = np.asarray(lengths, np.int64)
  if len(lengths) and (lengths.max() > width or lengths.min() < 1):
    raise ValueError(f"pack_rows: lengths must be 1..{width}, got {lengths.min()}..{lengths.max()}")
  row, offset, slot = (np.zeros(len(lengths), np.int64) for _ in range(3))
  by_room: list[list[int]] = [[] for _ in range(width + 1)]  # open rows by free columns
  used: list[int] = []  # per row: columns taken
  held: list[int] = []  # per row: sequences
  for n in np.argsort(-lengths, kind="stable"):
    size = int(lengths[n])
    room = next((r for r in range(size, width + 1) if by_room[r]), None)
    if room is None:
      r = len(used)
      used.append(0)
      held.append(0)
    else:
      r = by_room[room].pop()
    row[n], offset[n], slot[n] = r, used[r], held[r]
    used[r] += size
    held[r] += 1
    if held[r] < max_per_row and used[r] < width:
      by_room[width - used[r]].append(r)
  return row, offset, slot


def _packed_questions(input_ids: np.ndarray, lengths: np.ndarray,
                      width: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
  """Questions packed into rows of `width` (`pack_rows`, at most PACKED_QUESTIONS a row):
  ([input_ids, segment_ids, position_ids] [R, width], tokens per row [R], the question at each
  row's place [R, PACKED_QUESTIONS], -1 where none)."""
  row, offset, slot = pack_rows(lengths, width, PACKED_QUESTIONS)
  count = int(row.max()) + 1
  token_row = np.repeat(row, lengths)
  within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  column = np.repeat(offset, lengths) + within
  ids = np.zeros((count, width), input_ids.dtype)
  segments = np.zeros((count, width), np.int32)
  positions = np.zeros((count, width), np.int32)
  ids[token_row, column] = input_ids[np.repeat(np.arange(len(lengths)), lengths), within]
  segments[token_row, column] = np.repeat(slot + 1, lengths)
  positions[token_row, column] = within
  questions = np.full((count, PACKED_QUESTIONS), -1, np.int64)
  questions[row, slot] = np.arange(len(lengths))
  return [ids, segments, positions], np.bincount(row, lengths, count).astype(np.int64), questions


def encode_questions(model, tokenizer, questions: Sequence[str], *, max_query_length: int = 64,
                     batch_size: int = 64, mesh=None) -> tuple[np.ndarray, np.ndarray]:
  """(q_start, q_end) [Q, D] of question texts by the model's question encoders."""
  mesh = mesh or make_mesh()
  ids, mask = tokenizer.encode(list(questions), max_query_length)
  return question_vectors(bound_questions(model), ids, mask,
                          batch_size=round_to_devices(batch_size, mesh), mesh=mesh)
