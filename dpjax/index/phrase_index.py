"""A complete dump with one of its faiss indexes (`PhraseIndex`): the index searched, its hits
rescored exactly from the stored token vectors (`rescoring.Rescorer`) or a compact index's codes
(`compact`), and the best phrase of each retrieved unit.

A `PhraseIndex` is built from its search options, merged spans, hybrid search
(`hybrid.Hybrid`) and re-reading (`rereading.Rereader`); `with_options` gives the same index
with others, sharing what it loaded.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
from typing import Callable, Sequence

import faiss
import numpy as np

from dpjax.errors import DumpError
from dpjax.index import hybrid, rereading, scoring
from dpjax.index.compact import CompactIndex
from dpjax.index.device_search import DeviceFlat, use_device_search
from dpjax.index.dump_reader import Dump
from dpjax.index.faiss_index import check_index, index_folder
from dpjax.index.hits import Hits, ranked_spans
from dpjax.index.hybrid import Hybrid
from dpjax.index.manifest import INDEX_MANIFEST, check_index_of_dump
from dpjax.index.rereading import ReadTokens, Rereader
from dpjax.index.rescoring import Rescorer
from dpjax.index.units import UNITS, Phrase, check_request, count, document_key, sentence_bounds
from dpjax.io import read_json

# Bounds the [questions, passages] BM25 scores of a hybrid search.
_LEXICAL_ELEMENTS = 1 << 25


def _is_compact_index(dump_dir: pathlib.Path, index_name: str) -> bool:
  """Whether the dump's index `index_name` (a folder or a spec naming one) is a compact one,
  by its manifest (one unreadable: not; the index's own check names it)."""
  for name in (index_name, index_folder(index_name)):
    path = dump_dir / "indexes" / name / INDEX_MANIFEST
    if path.is_file():
      try:
        return json.loads(path.read_text(encoding="utf-8")).get("kind") == "compact"
      except (OSError, ValueError, AttributeError):
        return False
  return False


class IndexStorage(np.ndarray):
  """A view of a faiss index's own storage that holds the index (`owner`): the memory it
  reads is freed with the index, so the view keeps it alive (a rescorer kept after its phrase
  index, say)."""
  owner: object = None


class PhraseIndex:
  """A complete dump with one of its faiss indexes.

  Search options: `merge_spans` (overlapping answers of one passage are one result, the others
  listed under its `merged`), `hybrid` (`Hybrid`: BM25 scores of the dump's passages and
  sentences added; None: the dense search) and `reread` (`Rereader`: each question's top
  passages encoded again and their spans scored exactly; None: the index's scores).
  """

  def __init__(self, dump: Dump | str | os.PathLike, index_name: str = "Flat",
               nprobe: int | None = None, search_device: str = "auto", *,
               merge_spans: bool = True, hybrid: Hybrid | None = None,
               reread: Rereader | None = None, verify: bool = False):
    """The dump's index `index_name`; the sizes of its and the dump's files are checked against
    those recorded when written, and with `verify` their contents (`index.verify`). A compact
    index (`compact`) over a dump's directory reads the dump's manifest only: its passages are
    the index's own."""
    if not isinstance(dump, Dump):
      full = not _is_compact_index(pathlib.Path(dump), index_name)
      dump = Dump.load(dump, verify=verify, tokens=full, passages=full)
    self.dump = dump
    if not (self.dump.directory / "indexes" / index_name).is_dir():
      index_name = index_folder(index_name)  # a factory string ("IVFauto,SQ4") names its folder
    directory = self.dump.directory / "indexes" / index_name
    if not (directory / INDEX_MANIFEST).is_file():
      available = sorted(p.name for p in (self.dump.directory / "indexes").glob("*")
                         if (p / INDEX_MANIFEST).is_file())
      raise DumpError(f"{directory}: no index named {index_name!r} (available: {available}); "
                      "build it with `run.py index`")
    self.manifest = read_json(directory / INDEX_MANIFEST, DumpError,
                              "build the index again with `run.py index`")
    check_index(directory, self.manifest, contents=verify)
    check_index_of_dump(directory, self.manifest, self.dump.directory, self.dump.manifest)
    if nprobe is not None and nprobe < 1:
      raise ValueError(f"nprobe must be >= 1, got {nprobe}")
    self.compact = None
    if self.manifest.get("kind") == "compact":
      self._load_compact(directory, nprobe)
    else:
      threshold = self.manifest.get("filter_threshold")
      self.kept_mask = (None if threshold is None else
                        self.dump.filter_logits.astype(np.float32).max(1) >= threshold)
      self.index = self._device_index(search_device)
    if self.index is None:
      try:
        self.index = faiss.read_index(str(directory / "index.faiss"))
      except RuntimeError as e:  # a damaged or truncated file (faiss's C++ error)
        raise DumpError(f"{directory / 'index.faiss'}: unreadable ({str(e).splitlines()[0]}); "
                        "build the index again with `run.py index`") from None
      if hasattr(self.index, "nprobe") or "IVF" in self.manifest["resolved_spec"]:
        faiss.ParameterSpace().set_index_parameter(self.index, "nprobe",
                                                   nprobe or self.manifest["nprobe"])
    self._setup(merge_spans, hybrid, reread)

  def _load_compact(self, directory: pathlib.Path, nprobe: int | None) -> None:
    """A compact index: its codes searched in place (a residual one's `nprobe` passages first),
    the dump seen through it (its kept tokens only, numbered by rank: `CompactIndex`, and its
    passages), no dump vector or passage read."""
    self.compact = CompactIndex.load(directory, self.manifest,
                                     self.dump.manifest["num_passages"])
    self.dump = dataclasses.replace(
        self.dump, vectors=np.zeros((0, self.dump.manifest["dim"]), np.float16),
        filter_logits=np.zeros((0, 2), np.float16), token_passage=self.compact.token_passage,
        char_spans=self.compact.char_spans, passages=self.compact.passages, positions=None)
    self.kept_mask = None
    self.index = self.compact.searcher(nprobe)

  def _device_index(self, search_device: str) -> DeviceFlat | None:
    """The exact index searched on the accelerator (`use_device_search`): its vectors are the
    dump's, those the filter keeps; None for an approximate index or the host's faiss."""
    tokens = self.manifest["num_tokens"]
    if self.manifest["resolved_spec"] != "Flat" or not tokens or not use_device_search(
        search_device, 2 * tokens * self.dump.vectors.shape[1]):
      return None
    if self.kept_mask is None:
      return DeviceFlat(self.dump.vectors)
    kept = np.flatnonzero(self.kept_mask)
    if len(kept) != tokens:  # the filter logits changed after the index was built: its own set
      return None
    return DeviceFlat(self.dump.vectors[kept], kept)

  @classmethod
  def over_passages(cls, dump: Dump, passages: Sequence[int] | None = None, *,
                    search_device: str = "auto", merge_spans: bool = True) -> "PhraseIndex":
    """An exact (Flat, in memory) index over the tokens of some passages of a dump (default all).

    Phrase vectors do not depend on the other passages of a corpus, so the index of any
    subcorpus is a subset of the full dump's tokens: validation subcorpora need no new dump.
    """
    rows = np.arange(len(dump.passages)) if passages is None else np.unique(passages)
    return cls.over_tokens(dump, np.flatnonzero(np.isin(dump.token_passage, rows)),
                           num_passages=len(rows), search_device=search_device,
                           merge_spans=merge_spans)

  @classmethod
  def over_tokens(cls, dump: Dump, tokens: np.ndarray, *, num_passages: int | None = None,
                  search_device: str = "auto", merge_spans: bool = True) -> "PhraseIndex":
    """An exact (Flat, in memory) index over some tokens of a dump (e.g. those a filter keeps);
    phrases start and end only at these tokens. `search_device` as `index.search_device`."""
    self = cls.__new__(cls)
    self.dump = dump
    tokens = np.asarray(tokens, np.int64)
    if len(tokens) and use_device_search(search_device, 2 * len(tokens) * dump.vectors.shape[1]):
      self.index = DeviceFlat(dump.vectors[tokens], tokens)
    else:
      self.index = faiss.index_factory(dump.vectors.shape[1], "IDMap,Flat",
                                       faiss.METRIC_INNER_PRODUCT)
      for lo in range(0, len(tokens), 1 << 18):
        part = tokens[lo:lo + (1 << 18)]
        self.index.add_with_ids(dump.vectors[part].astype(np.float32), part)
    if num_passages is None:
      num_passages = len(np.unique(dump.token_passage[tokens]))
    self.kept_mask = np.zeros(len(dump.vectors), bool)
    self.kept_mask[tokens] = True
    self.compact = None
    self.manifest = {"spec": "Flat", "resolved_spec": "Flat", "labels": "token_id",
                     "num_tokens": int(len(tokens)), "num_passages": int(num_passages),
                     "fingerprint": dump.manifest["fingerprint"], "build_seconds": 0.0,
                     "index_bytes": int(len(tokens)) * (4 * dump.vectors.shape[1] + 8)}
    self._setup(merge_spans, None)
    return self

  def _setup(self, merge_spans: bool, hybrid: Hybrid | None,
             reread: Rereader | None = None) -> None:
    self.num_vectors = int(self.manifest["num_tokens"])
    self._sentences: dict[int, np.ndarray] = {}
    # The last questions' lexical results (`_lexical`), shared with `with_options` copies.
    self._lexical_cache: list = [None]
    self.rescorer = (self.compact.rescorer() if self.compact is not None else  # (its codes)
                     Rescorer(self._rescored_vectors(), self.dump.token_passage,
                              len(self.dump.passages), self.kept_mask, self.dump.positions))
    self._set_options(merge_spans, hybrid, reread)

  def _rescored_vectors(self):
    """The [N, D] vectors the rescoring reads: the exact index's float32 storage, or the dump's
    float16 vectors (converted by the rescoring, its convert compiled now, not searching)."""
    vectors = self._exact_vectors()
    if vectors is None:
      vectors = self.dump.vectors
      if self.num_vectors and vectors.dtype != np.float32:
        scoring.half_to_float32(np.zeros((scoring.CONVERT_ROWS, vectors.shape[1]),
                                         vectors.dtype))
    return vectors

  def _set_options(self, merge_spans: bool, hybrid: Hybrid | None,
                   reread: Rereader | None) -> None:
    if hybrid is not None:
      if not isinstance(hybrid, Hybrid):
        raise TypeError(f"hybrid must be a dpjax.index.hybrid.Hybrid or None, not "
                        f"{type(hybrid).__name__}")
      hybrid.sparse.check_of(self.dump.directory, self.dump.manifest)
    if reread is not None and not isinstance(reread, Rereader):
      raise TypeError(f"reread must be a dpjax.index.rereading.Rereader or None, not "
                      f"{type(reread).__name__}")
    self.merge_spans, self.hybrid, self.reread = bool(merge_spans), hybrid, reread

  _KEEP = object()

  def with_options(self, *, merge_spans: bool = _KEEP, hybrid: Hybrid | None = _KEEP,
                   reread: Rereader | None = _KEEP) -> "PhraseIndex":
    """This index with other search options (those not given kept): a new searcher sharing
    the dump, the faiss index, the rescoring and the last lexical results with this one."""
    other = copy.copy(self)
    other._set_options(self.merge_spans if merge_spans is self._KEEP else merge_spans,
                       self.hybrid if hybrid is self._KEEP else hybrid,
                       self.reread if reread is self._KEEP else reread)
    return other

  @property
  def passage_start(self) -> np.ndarray:
    """[P] each passage row's first token id (`Rescorer`)."""
    return self.rescorer.passage_start

  @property
  def passage_end(self) -> np.ndarray:
    """[P] one past each passage row's last token id."""
    return self.rescorer.passage_end

  @property
  def fingerprint(self) -> str:
    return self.dump.manifest["fingerprint"]

  def _hits(self, q_start: np.ndarray, q_end: np.ndarray, k: int) -> "Hits":
    """Top-k start and end token ids, [Q, k] each (-1 where fewer than k were found), from one
    faiss search of [q_start; q_end] (one pass over the vectors serves both)."""
    queries = np.ascontiguousarray(np.concatenate([q_start, q_end]), np.float32)
    if k < 1:  # an index without tokens (faiss refuses k = 0)
      labels = np.full((len(queries), 0), -1, np.int64)
    else:
      _, labels = self.index.search(queries, k)
    return Hits(labels[:len(q_start)], labels[len(q_start):], q_start, q_end, self.rescorer)

  def search_phrases(self, q_start: np.ndarray, q_end: np.ndarray, k: int = 10, *,
                     top_tokens: int | None = None, max_answer_length: int = 10,
                     hits: tuple[np.ndarray, np.ndarray] | None = None) -> list[list[Phrase]]:
    """Top-k phrases for each question vector pair (q_start, q_end: [Q, D]): the dense phrase
    search alone, every distinct span (no hybrid fusion, no merging: QSFT's candidates).

    `hits`: the (start, end) token ids of an earlier, wider search of the same questions
    ([Q, >= top_tokens] each); their first `top_tokens` columns are this search's hits.
    """
    k = count(k, "k (the number of phrases)")
    top_tokens = min(max(top_tokens or k, k), self.num_vectors)
    spans = self._spans(q_start, q_end, top_tokens, max_answer_length, hits)
    return [[self.phrase(int(s), int(e), float(x)) for s, e, x in zip(*(a[:k] for a in found))]
            for found in spans]

  def _spans(self, q_start, q_end, top_tokens: int, max_answer_length: int, hits=None,
             rows: np.ndarray | None = None):
    """Per question, (starts, ends, scores) of its distinct spans, best first, from its top
    `top_tokens` start and end hits: searched, or the first columns of `hits` (of these
    questions, or with `rows` of the questions at those rows of `hits`)."""
    count(max_answer_length, "max_answer_length (in tokens)")
    if hits is None:
      # Rescoring holds a few [queries, 2 top_tokens, max_answer_length] arrays: bound them.
      chunk = max(1, scoring.RESCORE_ELEMENTS // max(2 * top_tokens * max_answer_length, 1))
      results = []
      for lo in range(0, len(q_start), chunk):
        part = slice(lo, lo + chunk)
        starts, ends = self._hits(q_start[part], q_end[part], top_tokens)
        results += ranked_spans(*self.rescorer.rescore(q_start[part], q_end[part], starts, ends,
                                                       max_answer_length),
                                self.rescorer.num_tokens)
      return results
    if rows is None:
      rows = np.arange(len(q_start))
    if not self._asked(hits, q_start, q_end, rows):
      hits, rows = (Hits(hits[0][rows], hits[1][rows], q_start, q_end, self.rescorer),
                    np.arange(len(rows)))
    return hits.rescored(max_answer_length).spans(rows, top_tokens)

  def _asked(self, hits, q_start, q_end, rows: np.ndarray) -> bool:
    """Whether `hits` are this index's search of these questions (at its `rows`): `Hits` whose
    rescored spans these questions may share (`with_options` copies share their rescorer)."""
    return (isinstance(hits, Hits) and hits.rescorer is self.rescorer
            and np.array_equal(hits.queries[0][rows], q_start)
            and np.array_equal(hits.queries[1][rows], q_end))

  def _exact_vectors(self) -> np.ndarray | None:
    """The float32 [N, D] vectors of every dump token, row = token id, when the faiss index
    stores them so (an unfiltered Flat): a view of its storage, no copy. Else None."""
    if not hasattr(self, "_exact"):
      self._exact = None
      flat = faiss.downcast_index(self.index.index) if isinstance(
          self.index, faiss.IndexIDMap) else None
      n, dim = self.dump.vectors.shape
      if isinstance(flat, faiss.IndexFlat) and flat.ntotal == n and np.array_equal(
          faiss.vector_to_array(self.index.id_map), np.arange(n)):
        self._exact = faiss.rev_swig_ptr(flat.get_xb(), n * dim).reshape(n, dim).view(
            IndexStorage)
        self._exact.owner = self.index  # (a rescorer outliving this index keeps it alive)
    return self._exact

  def phrase(self, start: int, end: int, score: float, read: ReadTokens | None = None
             ) -> Phrase:
    """The `Phrase` of tokens [start, end] (token ids, or a search's re-read ones `read`) with
    its passage and text."""
    if read is not None and start >= read.first:
      passage = int(read.passage[start - read.first])
      s, e = int(read.char_spans[start - read.first, 0]), int(read.char_spans[end - read.first, 1])
    else:
      passage = int(self.dump.token_passage[start])
      s, e = int(self.dump.char_spans[start, 0]), int(self.dump.char_spans[end, 1])
    return Phrase(score, start, end, passage, s, e, self.dump.passages[passage].text[s:e])

  def _passages_of(self, tokens: np.ndarray, read: ReadTokens | None = None) -> np.ndarray:
    """[N] the passage rows of token ids [N] (the index's, or a search's re-read ones)."""
    tokens = np.asarray(tokens, np.int64)
    if read is None:
      return np.asarray(self.dump.token_passage[tokens], np.int64)
    out = np.empty(len(tokens), np.int64)
    own = tokens < read.first
    out[own] = self.dump.token_passage[tokens[own]]
    out[~own] = read.passage[tokens[~own] - read.first]
    return out

  def sentence_of(self, phrase: Phrase) -> tuple[int, int]:
    """(start, end) characters of the sentence holding the phrase's first character."""
    if phrase.passage not in self._sentences:
      text = self.dump.passages[phrase.passage].text
      self._sentences[phrase.passage] = np.array(sentence_bounds(text))
    bounds = self._sentences[phrase.passage]
    i = int(np.searchsorted(bounds, phrase.start_char, "right")) - 1
    return int(bounds[i]), int(bounds[i + 1])

  def unit_key(self, phrase: Phrase, unit: str):
    """What identifies the phrase's `unit` (its span, sentence, passage row or document): two
    phrases of one key are one result of a unit search."""
    if unit == "phrase":
      return (phrase.start_token, phrase.end_token)
    if unit == "sentence":
      return (phrase.passage, self.sentence_of(phrase))
    if unit == "passage":
      return phrase.passage
    if unit == "document":
      return document_key(self.dump.passages[phrase.passage])
    raise ValueError(f"unknown retrieval unit {unit!r}; one of {UNITS}")

  def _best_units(self, starts: np.ndarray, ends: np.ndarray, scores: np.ndarray, unit: str,
                  k: int, read: ReadTokens | None = None) -> list[Phrase]:
    """The best phrase of each of the top-k units among ranked spans (token ids, or re-read
    ones of `read`); phrases overlapping a better one are merged into it (`merge_spans`, phrase
    unit)."""
    if unit == "phrase" and self.merge_spans:
      leads, others = hybrid.overlap_groups(starts, ends, k)
      best = []
      for lead, merged in zip(leads, others):
        phrase = self.phrase(int(starts[lead]), int(ends[lead]), float(scores[lead]), read)
        phrase.merged = [self.phrase(int(starts[i]), int(ends[i]), float(scores[i]), read)
                         for i in merged]
        best.append(phrase)
      return best
    return [self.phrase(int(starts[i]), int(ends[i]), float(scores[i]), read)
            for i in self._first_of_units(starts, ends, unit, read)[:k]]

  def lexical_rows(self) -> int | None:
    """Questions a hybrid search scores with BM25 at once (None: a dense search); a search of
    more splits them, and only the last part's lexical results are kept for the next search."""
    if self.hybrid is None or not self.hybrid.active:
      return None
    return max(1, _LEXICAL_ELEMENTS // max(self.hybrid.sparse.num_passages, 1))

  def _lexical(self, q_start: np.ndarray, q_end: np.ndarray, texts: Sequence[str] | None,
               max_answer_length: int):
    """(BM25 scores [Q, P], top BM25 passages per question, their spans `lexical_spans`, the
    questions' terms `SparseIndex.question_terms` for their sentence scores, the candidates
    `_fused` made of them) for hybrid search, or None for a dense search. They depend on neither
    k, unit nor the weights: the last questions' are kept for the next search of them (with the
    sentence scores computed so far)."""
    if self.lexical_rows() is None:
      return None
    if texts is None or isinstance(texts, str) or len(texts) != len(q_start):
      raise ValueError("hybrid search (index.sparse) needs the text of every question searched")
    sparse, passages = self.hybrid.sparse, self.hybrid.passages
    key = (tuple(texts), sparse, passages, max_answer_length)
    cached = self._lexical_cache[0]
    if cached and cached[0] == key and all(np.array_equal(a, b) for a, b in
                                           zip(cached[1], (q_start, q_end))):
      found = cached[2]  # the same questions' next request (or weight): computed once
    else:
      bm25 = sparse.scores(list(texts))
      top = hybrid.top_passages(bm25, passages)
      found = (bm25, top,
               hybrid.lexical_spans(self.rescorer, q_start, q_end, top, max_answer_length),
               sparse.question_terms(list(texts)), {})  # ({}: `_fused`'s candidates)
    self._lexical_cache[0] = (key, (np.array(q_start), np.array(q_end)), found)
    return found

  def _reread(self, q_start: np.ndarray, q_end: np.ndarray, questions: np.ndarray,
              ranked: list, lexical, max_answer_length: int, fetch: int
              ) -> tuple[ReadTokens, list, list]:
    """(the re-read tokens, `ranked` with the spans of each question's top `reread.passages`
    passages replaced by their re-read spans, fused as the search fuses: `rereading.rerank`,
    per question whether its `fetch` ranked spans held too few passages: `wants_wider`) for the
    questions at rows `questions` of q_start / q_end."""
    passages = [self._passages_of(found[0]) for found in ranked]
    picks = [rereading.top_passages(rows, self.reread.passages, found[2], self.reread.margin)
             for rows, found in zip(passages, ranked)]
    wider = [len(rows) >= fetch and rereading.wants_wider(rows, self.reread.passages, found[2],
                                                          self.reread.margin)
             for rows, found in zip(passages, ranked)]
    read, spans = rereading.read_spans(self.reread, self.dump.passages, q_start[questions],
                                       q_end[questions], picks, max_answer_length,
                                       first=self.rescorer.num_tokens,
                                       cuts=self._reread_cuts(ranked, passages, picks))
    out = []
    for q, found, rows, pick, (starts, ends, scores) in zip(questions, ranked, passages, picks,
                                                           spans):
      fused = scores.astype(np.float32)
      if lexical is not None:
        at = starts - read.first
        fused = hybrid.fused_scores(
            fused, lexical[0][q][read.passage[at]], self.hybrid.weight,
            lambda: self.hybrid.sparse.sentence_scores(lexical[3][q], read.passage[at],
                                                       read.char_spans[at, 0],
                                                       self.dump.passages),
            self.hybrid.sentence_weight)
      out.append(rereading.rerank(found, rows, pick, (starts, ends, fused)))
    return read, out, wider

  def _reread_cuts(self, ranked: list, passages: list, picks: list) -> list | None:
    """Per question, the part of each picked passage's text re-reading reads
    (`Rereader.windows`, around the passage's best ranked span), or None for whole passages."""
    if self.reread.window is None:
      return None
    cuts = []
    for (starts, ends, _), rows, pick in zip(ranked, passages, picks):
      best = np.array([int(np.argmax(rows == row)) for row in pick], np.int64)  # ranked first
      spans = np.stack([self.dump.char_spans[starts[best], 0],
                        self.dump.char_spans[ends[best], 1]], 1).reshape(-1, 2)
      cuts.append(self.reread.windows([self.dump.passages[int(r)].text for r in pick], spans))
    return cuts

  def _fused(self, lexical, q: int, dense: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Question q's `dense` spans fused with its BM25 passages' spans (`hybrid.fuse`). Their
    `hybrid.candidates`, which no weight changes, are kept with the lexical results for the
    next search of the same spans (another request, or another weight of a grid)."""
    key = (q, *(np.ascontiguousarray(a).tobytes() for a in dense))
    found = lexical[4].get(key)
    if found is None:
      found = lexical[4][key] = hybrid.candidates(dense, lexical[2][q], lexical[0][q],
                                                  self.dump.token_passage)
    return hybrid.ranked(found, self.hybrid.weight, self._sentence_of(lexical[3][q]),
                         self.hybrid.sentence_weight)

  def _sentence_of(self, terms) -> Callable[[np.ndarray], np.ndarray]:
    """start tokens [N] -> [N] the BM25 of the question of `terms` (`SparseIndex.question_terms`)
    against the sentence each token begins in: `hybrid.fuse`'s sentence term."""
    return lambda starts: self.hybrid.sparse.sentence_scores(
        terms, self.dump.token_passage[starts], self.dump.char_spans[starts, 0],
        self.dump.passages)

  def _first_of_units(self, starts: np.ndarray, ends: np.ndarray, unit: str,
                      read: ReadTokens | None = None) -> np.ndarray:
    """Positions of the first (best) phrase of each distinct unit among ranked phrases."""
    if unit == "phrase":  # the spans are distinct already
      return np.arange(len(starts))
    if unit == "sentence":
      codes = {}
      keys = [codes.setdefault(self.unit_key(self.phrase(int(s), int(e), 0.0, read), unit),
                               len(codes))
              for s, e in zip(starts, ends)]
    elif unit == "passage":
      keys = self._passages_of(starts, read)
    else:
      keys = self._documents()[self._passages_of(starts, read)]
    return np.sort(np.unique(np.asarray(keys, np.int64), return_index=True)[1])

  def _documents(self) -> np.ndarray:
    """A document number of every passage row (`document_key`): a compact index's stored
    digests of them (memory mapped), else numbered from the passages once."""
    if not hasattr(self, "_document_of"):
      if self.compact is not None:
        self._document_of = self.compact.passages.documents
      else:
        names: dict = {}
        self._document_of = np.array([names.setdefault(document_key(p), len(names))
                                      for p in self.dump.passages], np.int64)
    return self._document_of

  def fetch_bounds(self, k: int, *, top_tokens: int | None = None,
                   max_fetch: int | None = None) -> tuple[int, int]:
    """(first, most) phrases a unit search asks for: it starts at `first` and grows to at most
    `most` (20 k by default) while a question has fewer than k distinct units (or fewer passages
    than it re-reads: `rereading.wants_wider`)."""
    # Re-reading R passages starts from 2 R phrases (they hold fewer passages than phrases).
    first = max(top_tokens or 2 * k, k, 2 * (self.reread.passages if self.reread else 0))
    # A question whose best phrases crowd into few units would otherwise grow the fetch (and
    # the exact rescoring) without bound; it then gets fewer than k units. Every token a hit
    # (a search of as many tokens as the index has) gives up to two phrases per token: a cap at
    # the token count would cut a small index's phrases, and its last units, in half.
    return first, min(max(max_fetch or 20 * k, first), 2 * self.num_vectors)

  def hits(self, q_start: np.ndarray, q_end: np.ndarray, n: int) -> "Hits":
    """Top-n start and end token ids ([Q, n] each) of one index search, for `search(hits=)`:
    the searches given them rescore each hit once between them."""
    return self._hits(q_start, q_end, min(n, self.num_vectors))

  def search(self, q_start: np.ndarray, q_end: np.ndarray, k: int = 10, unit: str = "phrase",
             *, top_tokens: int | None = None, max_answer_length: int = 10,
             max_fetch: int | None = None, hits: tuple[np.ndarray, np.ndarray] | None = None,
             texts: Sequence[str] | None = None) -> list[list[tuple[Phrase, object]]]:
    """Top-k units (each with its best phrase) per question.

    `hits`: `self.hits(q_start, q_end, n)` of these questions, shared by several searches (e.g.
    phrases and passages): rounds that need at most n tokens use its first columns instead of
    searching the index again (the same hits, up to ties of an approximate index's scores).
    `texts`: the questions' texts, which hybrid search (`hybrid`) needs for BM25.
    """
    k = check_request(k, unit)
    count(max_answer_length, "max_answer_length (in tokens)")
    step = self.lexical_rows()
    if step and len(q_start) > step:  # the BM25 scores of `step` questions at a time
      return [found for lo in range(0, len(q_start), step) for found in self.search(
          q_start[lo:lo + step], q_end[lo:lo + step], k, unit, top_tokens=top_tokens,
          max_answer_length=max_answer_length, max_fetch=max_fetch,
          texts=None if texts is None else texts[lo:lo + step],
          hits=None if hits is None else (hits[0][lo:lo + step], hits[1][lo:lo + step]))]
    lexical = self._lexical(q_start, q_end, texts, max_answer_length)
    # the vectors that score re-read spans: the search's, or those of re-reading's own encoder
    scoring = (None if self.reread is None else
               self.reread.question_vectors(texts, q_start, q_end))
    first, max_fetch = self.fetch_bounds(k, top_tokens=top_tokens, max_fetch=max_fetch)
    fetch = first
    units: list = [None] * len(q_start)
    pending = np.arange(len(q_start))
    if hits is not None and not self._asked(hits, q_start, q_end, pending):
      # its rounds share their rescoring
      hits = Hits(hits[0], hits[1], q_start, q_end, self.rescorer)
    wide, wide_row = (None, None) if hits is None else (hits, np.arange(len(q_start)))
    while len(pending):
      needed = min(fetch, self.num_vectors)
      if (wide is None and fetch > first) or (wide is not None and wide[0].shape[1] < needed):
        # One index search at max_fetch serves every later round: the top-f hits of a search
        # are the first f of a wider one, so only the rescoring grows round by round.
        wide = self.hits(q_start[pending], q_end[pending], max_fetch)
        wide_row = np.full(len(q_start), -1)
        wide_row[pending] = np.arange(len(pending))
      spans = self._spans(q_start[pending], q_end[pending], needed, max_answer_length, wide,
                          None if wide is None else wide_row[pending])
      ranked = []
      for q, (starts, ends, scores) in zip(pending, spans):  # the best `fetch` phrases
        ranked.append((starts[:fetch], ends[:fetch], scores[:fetch]))
        if lexical is not None:
          ranked[-1] = self._fused(lexical, q, ranked[-1])
      read, wider = None, [False] * len(pending)
      if self.reread is not None:  # (a question short of passages to re-read is fetched wider)
        read, ranked, wider = self._reread(*scoring, pending, ranked, lexical,
                                           max_answer_length, fetch)
      short = []
      for q, found, more in zip(pending, ranked, wider):
        units[q] = [(p, self.unit_key(p, unit))
                    for p in self._best_units(*found, unit, k, read)]
        if (len(units[q]) < k or more) and fetch < max_fetch:
          short.append(q)
      pending = np.array(short, dtype=np.int64)
      fetch = min(fetch * 4, max_fetch)
    return units

  def result(self, phrase: Phrase, unit: str = "phrase") -> dict:
    """A JSON-friendly description of a retrieved phrase (and its unit)."""
    passage = self.dump.passages[phrase.passage]
    out = {"answer": phrase.text, "score": phrase.score, "start_char": phrase.start_char,
           "end_char": phrase.end_char, "passage_id": passage.id,
           "passage_row": phrase.passage, "title": passage.title,
           "passage": passage.text}
    if unit == "sentence":
      s, e = self.sentence_of(phrase)
      out["sentence"] = passage.text[s:e].strip()
    if phrase.merged:
      out["merged"] = [{"answer": m.text, "score": m.score, "start_char": m.start_char,
                        "end_char": m.end_char} for m in phrase.merged]
    return out
