"""Phrase search over a dump + faiss index, and retrieval of sentences, passages, documents.

An exact (Flat) index is searched on the accelerator when there is one (`DeviceFlat`,
`index.search_device`); the approximate ones (IVF, PQ) by faiss on the host.

For a question with vectors (q_start, q_end): the index returns the top start tokens for q_start
and the top end tokens for q_end; every start hit i is paired with its best end j in
[i, i + max_answer_length) within the same passage, and every end hit j with its best start,
both scored exactly from the stored token vectors: s = q_start . h_i + q_end . h_j. Phrases are
deduplicated and sorted. A sentence, passage or document scores as its best phrase; more phrases
are fetched until k distinct units are found or `max_fetch` phrases (default 20 k; the reference
retrieves ~2k phrases for k units) have been asked for; the index itself is searched at most
twice per question (the first round, then once at `max_fetch` for the questions still short), and
`PhraseSearcher.search_many` serves several searches of the same questions with one. The hits of an
index search (`Hits`) keep what rescoring them found: the rounds and searches they serve rescore
each hit once.

Here: `PhraseSearcher`, questions in and results out. The index search and the rescoring are
`PhraseIndex`'s (`phrase_index.py`), the rescoring's token scores `scoring.py`'s, the retrieval
units `units.py`'s and the shared hits of an index search `hits.py`'s.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from dpjax.data.tokenization import Tokenizer
from dpjax.errors import DumpError
from dpjax.index.evaluate import retrieve_texts
from dpjax.index.manifest import encoder_fingerprint
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.rereading import Rereader
from dpjax.index.units import check_request
from dpjax.model_files import DEFAULT_MODEL
from dpjax.models.encoders import bound_questions, compile_questions, question_vectors
from dpjax.parallel import make_mesh, round_to_devices

log = logging.getLogger(__name__)


def _tokenless(attention_mask: np.ndarray) -> np.ndarray:
  """The rows of tokenised questions that hold [CLS] [SEP] only."""
  return np.flatnonzero(attention_mask.sum(1) <= 2)


def _dump_tokenizer(index: PhraseIndex) -> Tokenizer:
  """The tokenizer the index's dump was made with (`run.py dump` records it), else MiniLM's."""
  name = index.dump.manifest.get("model", {}).get("tokenizer")
  if name is None:  # a dump from before the tokenizer was recorded, or made from Python
    log.warning("%s does not say which tokenizer made it: questions are tokenized by %s's; "
                "pass PhraseSearcher(..., tokenizer=) if the model has another",
                index.dump.directory, DEFAULT_MODEL)
    return Tokenizer.from_pretrained()
  return Tokenizer.from_pretrained(name)


class PhraseSearcher:
  """Question answering over a phrase index: `PhraseSearcher(model, index).search(questions)`.

  `reread` (> 0): each question's top `reread` passages are encoded again by the model and
  their spans scored exactly (`rereading.Rereader`): for an index of codes or of the filter's
  kept tokens, at one encoding per passage; with `reread_margin`, only those holding a span
  ranked within it of the best (none when the best leads the next span by it); with
  `reread_window`, a passage only around its best span (`rereading.window_of`); with
  `reread_model` (a model of the same phrase encoder, e.g. the trained one where `model` is
  its QSFT), the re-read spans scored by its question encoder and the candidates by `model`'s.

  Named `DensePhrases` before, as the model class `dpjax.models.DensePhrases` is: that name is
  kept as an alias (`dpjax.DensePhrases`)."""

  def __init__(self, model, index: PhraseIndex, tokenizer=None, *, max_query_length: int = 64,
               batch_size: int = 64, mesh=None, check_model: bool = True, reread: int = 0,
               reread_margin: float | None = None, reread_window: int | None = None,
               reread_model=None):
    if check_model and encoder_fingerprint(model) != index.fingerprint:
      raise DumpError(f"the model's phrase encoder is not the one that made {index.dump.directory}"
                      " (fingerprints differ): dump the corpus again with this model")
    self.model, self.index = model, index
    self.tokenizer = tokenizer or _dump_tokenizer(index)
    self.max_query_length = max_query_length
    self.mesh = mesh or make_mesh()
    for name, value in (("reread_margin", reread_margin), ("reread_window", reread_window),
                        ("reread_model", reread_model)):
      if value is not None and not reread:
        raise ValueError(f"{name} without reread: set reread to the most passages a question "
                         "may re-read")
    self.batch_size = round_to_devices(batch_size, self.mesh)
    self._encode = bound_questions(model)
    # The question encoder that scores re-read spans, when it is not the one ranking them.
    self._scorer = None if reread_model is None else bound_questions(reread_model)
    if reread:
      self.index = index.with_options(reread=Rereader(
          model if reread_model is None else reread_model, self.tokenizer, index.dump.manifest,
          reread, margin=reread_margin, window=reread_window, mesh=self.mesh,
          questions=None if self._scorer is None else self._vectors_of(self._scorer)))

  def compile(self, max_questions: int | None = None) -> int:
    """Compiles the question encoder for every call `encode` makes with at most `max_questions`
    questions at once (`compile_questions`), and re-reading's phrase encoder for every call it
    makes (`Rereader.compile`), in threads; returns the shapes."""
    shapes = sum(compile_questions(encode, self.batch_size, self.mesh, self.max_query_length,
                                   max_questions)
                 for encode in (self._encode, self._scorer) if encode is not None)
    return shapes + (0 if self.index.reread is None else self.index.reread.compile())

  def empty_questions(self, questions: Sequence[str]) -> list[int]:
    """The questions that hold no token: empty, or only characters the tokenizer drops (control
    and format characters such as a zero-width space, U+FEFF, NUL)."""
    return _tokenless(self.tokenizer.encode(list(questions), self.max_query_length)[1]).tolist()

  def encode(self, questions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The questions' start and end vectors, [Q, D] each; a question without tokens is a
    ValueError naming it."""
    if isinstance(questions, str):
      raise ValueError("questions must be a list of strings, not one string")
    return self._vectors_of(self._encode)(questions)

  def _vectors_of(self, encode) -> Callable[[Sequence[str]], tuple[np.ndarray, np.ndarray]]:
    """texts -> their start and end vectors by the bound question encoder `encode` (`encode`'s
    and the re-reading scorer's); a text without tokens is a ValueError naming it."""
    def vectors(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
      ids, mask = self.tokenizer.encode(list(texts), self.max_query_length)
      empty = _tokenless(mask)
      if len(empty):
        raise ValueError(f"question {int(empty[0])} ({texts[empty[0]][:40]!r}) has no tokens: it "
                         f"is empty or only characters the tokenizer drops ({len(empty)} such)")
      return question_vectors(encode, ids, mask, batch_size=self.batch_size, mesh=self.mesh)
    return vectors

  def search(self, questions: str | Sequence[str], k: int = 10, unit: str = "phrase",
             **kwargs) -> list[list[dict]] | list[dict]:
    """The top-k units (`phrase`, `sentence`, `passage` or `document`) of each question, best
    first, each a dict (`PhraseIndex.result`: answer, score, character span, passage id, title,
    text); one question (a string) gives its list, a list of questions a list per question.
    `kwargs` go to `PhraseIndex.search` (`max_answer_length`, `top_tokens`, `max_fetch`)."""
    single = isinstance(questions, str)
    texts = [questions] if single else list(questions)
    q_start, q_end = self.encode(texts)
    found = self.index.search(q_start, q_end, k, unit, texts=texts, **kwargs)
    results = [[self.index.result(p, unit) for p, _ in units] for units in found]
    return results[0] if single else results

  def search_many(self, questions: Sequence[str], requests: Sequence[tuple[int, str]],
                  **kwargs) -> list[list[list[dict]]]:
    """Several searches of the same questions, e.g. `[(10, "phrase"), (20, "passage")]`: the
    questions are encoded once and the index is searched once, as wide as the widest needs;
    256 questions at a time, the next encoded while the last are searched (`retrieve_texts`)."""
    if not requests:
      raise ValueError("search_many needs at least one (k, unit) request")
    if isinstance(questions, str):  # (its letters would be the questions)
      raise ValueError("search_many takes a list of questions, not one string")
    # checked before the index search that the widest request sizes
    requests = [(check_request(k, unit), unit) for k, unit in requests]
    found = retrieve_texts(self.index, self.encode, list(questions), requests, shared_hits=True,
                           **kwargs)
    return [[[self.index.result(p, unit) for p, _ in units] for units in per_request]
            for (_, unit), per_request in zip(requests, found)]


DensePhrases = PhraseSearcher  # the searcher's name before it was renamed
