"""The BM25 index of a dump's passages, the lexical half of hybrid search.

BM25 as the project's BM25 peer computes it (experiments/benchmarks/passage_retrieval.py):
bm25s with k1 0.9 and b 0.4 (Pyserini's defaults), English stop words and the Snowball English
stemmer of PyStemmer, over "title text" of each passage. It is written into `<dump>/indexes/bm25/`
beside the faiss indexes, through a temporary folder renamed when complete, with a manifest that
names the dump it was built from (refused against any other), each file's size and digest, the
sentences' count and mean length, and the hybrid weights chosen for it (`record_weight`).

Hybrid search also adds the BM25 of the sentence a phrase starts in: "title sentence" of each
sentence of its passage (`units.sentence_bounds`, the sentence unit's sentences) as a document of
the sentences, BM25 as bm25s scores an index of them (their idf, their mean length), computed at
query time. Of the sentences only each vocabulary term's document frequency among them is stored
(`sentence_df.npy`, about 0.04 bytes per corpus token on SQuAD-open small), not an index of them;
only the sentences of the passages a question's candidates come from are tokenized, each passage
once while it stays in a bounded cache.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pathlib
import re
import threading
import time
from typing import NamedTuple, Sequence

import numpy as np

from dpjax.errors import DumpError
from dpjax.index.units import sentence_bounds
from dpjax.io import (checksum_problems, commit_directory, folder_checksums, read_json, remove,
                      write_json)

log = logging.getLogger(__name__)

FOLDER = "bm25"
MANIFEST = "sparse_manifest.json"
SETTINGS = {"method": "bm25 (bm25s, lucene idf)", "k1": 0.9, "b": 0.4, "stopwords": "en",
            "stemmer": "snowball english (PyStemmer)", "text": "title text",
            "sentences": "title sentence (units.sentence_bounds), scored at query time with the "
                         "sentences' idf (sentence_df.npy) and mean length"}
BUILD_HINT = "build it with `run.py index --set index.sparse=True`"
SENTENCE_DF = "sentence_df.npy"  # [V] each vocabulary term's document frequency among sentences
# Passages whose tokenized sentences a SparseIndex keeps (least recently used dropped first).
SENTENCE_CACHE_PASSAGES = 1 << 14


def sparse_folder(dump_dir: str | os.PathLike) -> pathlib.Path:
  """The BM25 index's folder of a dump: `<dump>/indexes/bm25`."""
  return pathlib.Path(dump_dir) / "indexes" / FOLDER


def _bm25s():
  try:
    import bm25s
    import Stemmer
  except ImportError as e:  # declared in setup.py; an image without them cannot search lexically
    raise DumpError(f"hybrid search needs bm25s and PyStemmer ({e}): "
                    "pip install bm25s PyStemmer") from None
  return bm25s, Stemmer.Stemmer("english")


_STEMMERS = threading.local()  # a PyStemmer stemmer per thread (an instance is not shared)
_WORDS = re.compile(r"(?u)\b\w\w+\b").findall  # bm25s.tokenize's token pattern


def term_ids(texts: Sequence[str], vocab: dict) -> list[list[int]]:
  """Each text's terms as `vocab`'s ids (-1 for a term it lacks), as `tokenize` makes them
  (lower case, bm25s's token pattern and English stop words, each distinct word stemmed once)
  without bm25s's per-text work: the sentence term tokenizes thousands of short texts a batch."""
  local = _STEMMERS
  if not hasattr(local, "stemmer"):
    bm25s, local.stemmer = _bm25s()
    local.stop = frozenset(bm25s.stopwords.STOPWORDS_EN)  # SETTINGS' "en"
  words = [[w for w in _WORDS(text.lower()) if w not in local.stop] for text in texts]
  unique = list(dict.fromkeys(w for found in words for w in found))
  ids = {w: vocab.get(stem, -1) for w, stem in zip(unique, local.stemmer.stemWords(unique))}
  return [[ids[w] for w in found] for found in words]


def tokenize(texts: Sequence[str], *, ids: bool = False):
  """Stemmed terms of each text, as the index's passages were tokenized (`ids`: bm25s's
  vocabulary and ids, what an index is built from)."""
  bm25s, stemmer = _bm25s()
  return bm25s.tokenize(list(texts), stopwords=SETTINGS["stopwords"], stemmer=stemmer,
                        return_ids=ids, show_progress=False)


def passage_text(passage) -> str:
  """What BM25 indexes of a passage: "title text"."""
  return f"{passage.title} {passage.text}"


def sentence_texts(passage) -> tuple[list[int], list[str]]:
  """(first character of each sentence of the passage (`units.sentence_bounds`), "title
  sentence" of each): what the sentence term scores."""
  bounds = sentence_bounds(passage.text)
  return bounds[:-1], [f"{passage.title} {passage.text[a:b]}"
                       for a, b in zip(bounds[:-1], bounds[1:])]


def bm25_of(texts: Sequence[str], k1: float = SETTINGS["k1"], b: float = SETTINGS["b"]):
  """A bm25s BM25 of `texts` with `SETTINGS` (this index's and the BM25 peer's, one place;
  another k1 or b for a study of them)."""
  bm25s, _ = _bm25s()
  retriever = bm25s.BM25(k1=k1, b=b)
  retriever.index(tokenize(texts, ids=True), show_progress=False)
  return retriever


def build_sparse(dump_dir: str | os.PathLike, passages: Sequence, dump_manifest: dict,
                 ) -> pathlib.Path:
  """Builds and writes the BM25 index of a complete dump's passages (in row order); returns its
  folder. A BM25 index of the same dump already there is kept with its recorded weight."""
  final = sparse_folder(dump_dir)
  if (final / MANIFEST).is_file():
    try:
      SparseIndex(dump_dir, dump_manifest)
      log.info("BM25 index %s: already built from this dump", final)
      return final
    except DumpError as e:
      log.warning("%s; building it again", e)
  start = time.perf_counter()
  texts = [passage_text(p) for p in passages]
  retriever = bm25_of(texts)
  sentences = [text for p in passages for text in sentence_texts(p)[1]]
  lengths, frequency = _sentence_counts(sentences, retriever.vocab_dict)
  tmp = final.with_name(final.name + ".tmp")
  remove(tmp)
  tmp.mkdir(parents=True)
  try:
    retriever.save(str(tmp), show_progress=False)
    np.save(tmp / SENTENCE_DF, frequency)
    files = folder_checksums(tmp)
    manifest = {"kind": "bm25", "settings": SETTINGS, "num_passages": len(texts),
                "num_sentences": len(sentences),
                "sentence_length": float(np.mean(lengths)) if len(lengths) else 0.0,
                "fingerprint": dump_manifest["fingerprint"],
                "dump_id": dump_manifest.get("dump_id", ""),
                "index_bytes": sum(f["bytes"] for f in files.values()),
                "build_seconds": time.perf_counter() - start, "weight": None,
                "sentence_weight": None, "files": files}
    write_json(tmp / MANIFEST, manifest)
    remove(final)
    commit_directory(tmp, final)
  except BaseException:
    remove(tmp)
    raise
  log.info("BM25 index %s: %d passages, %d sentences, %.1f s", final, len(texts),
           len(sentences), manifest["build_seconds"])
  return final


def _sentence_counts(sentences: Sequence[str], vocab: dict) -> tuple[np.ndarray, np.ndarray]:
  """(each sentence's length in terms [S], each term of `vocab`'s document frequency among the
  sentences [V], in the smallest unsigned type holding the largest: uint16 on SQuAD-open)."""
  ids = term_ids(sentences, vocab)
  lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
  words = np.fromiter((t for terms in ids for t in terms), np.int64, count=int(lengths.sum()))
  sentence = np.repeat(np.arange(len(ids), dtype=np.int64), lengths)
  known = words >= 0  # (a sentence's "title sentence" terms all come from its passage's text)
  pairs = np.unique(sentence[known] * max(len(vocab), 1) + words[known])
  frequency = np.bincount(pairs % max(len(vocab), 1), minlength=len(vocab))
  dtype = np.uint16 if frequency.max(initial=0) <= np.iinfo(np.uint16).max else np.uint32
  return lengths, frequency.astype(dtype)


def record_weight(dump_dir: str | os.PathLike, weight: float, sentence_weight: float,
                  tuning: dict) -> None:
  """Records the hybrid weights (passage and sentence BM25) and how they were chosen in the BM25
  index's manifest."""
  path = sparse_folder(dump_dir) / MANIFEST
  manifest = read_json(path, DumpError, BUILD_HINT)
  manifest.update(weight=float(weight), sentence_weight=float(sentence_weight),
                  weight_tuning=tuning)
  write_json(path, manifest)


@dataclasses.dataclass
class QuestionTerms:
  """A question's stemmed terms that the passages hold, for its sentence scores.

  ids: [m] their ids in the index's vocabulary, ascending; weights: [m] float32, each term's
  idf over the sentences times its count in the question. The sentences scored so far for it are
  kept (`scored`, the passage rows; `keys`: passage row << 32 | first character, ascending;
  `values`: their scores), so the searches of one question (its requests, every weight tried)
  score a passage once.
  """
  ids: np.ndarray
  weights: np.ndarray
  scored: set = dataclasses.field(default_factory=set, repr=False, compare=False)
  keys: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64),
                                       repr=False, compare=False)
  values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32),
                                         repr=False, compare=False)


class _Sentences(NamedTuple):
  """One passage's sentences, tokenized: first characters [n], lengths in terms [n] and the
  terms of all of them in order [sum of lengths] (vocabulary ids, -1 for a term the passages
  lack)."""
  starts: np.ndarray
  lengths: np.ndarray
  terms: np.ndarray


class SparseIndex:
  """A dump's BM25 index, checked against the dump: `scores(texts)` gives every passage's BM25
  score for each question, `sentence_scores` the BM25 of the sentences of given characters."""

  def __init__(self, dump_dir: str | os.PathLike, dump_manifest: dict, *, verify: bool = False):
    self.directory = sparse_folder(dump_dir)
    if not (self.directory / MANIFEST).is_file():
      raise DumpError(f"{self.directory}: no BM25 index for hybrid search (index.sparse); "
                      f"{BUILD_HINT}")
    self.manifest = read_json(self.directory / MANIFEST, DumpError, BUILD_HINT)
    problems = checksum_problems(self.directory, self.manifest.get("files", {}), contents=verify)
    if problems:
      raise DumpError(f"{problems[0]}: the BM25 index is damaged; {BUILD_HINT}")
    self.check_of(dump_dir, dump_manifest)
    if self.manifest.get("settings") != SETTINGS:
      raise DumpError(f"{self.directory}: a BM25 index of other settings "
                      f"({self.manifest.get('settings')}); {BUILD_HINT}")
    bm25s, _ = _bm25s()
    try:
      # Memory-mapped: the scores are read where a question's terms point.
      self.retriever = bm25s.BM25.load(str(self.directory), mmap=True, show_progress=False)
      self.sentence_length = float(self.manifest["sentence_length"]) or 1.0
      self.num_sentences = int(self.manifest["num_sentences"])
      self._check_columns(self.retriever)
      self._idf = self._sentence_idf(np.load(self.directory / SENTENCE_DF),
                                     len(self.retriever.vocab_dict), self.num_sentences)
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:  # damaged, same sizes
      reason = (str(e).splitlines() or [""])[0][:200]
      raise DumpError(f"{self.directory}: the BM25 index is unreadable ({type(e).__name__}: "
                      f"{reason}); {BUILD_HINT}") from None
    self.num_passages = int(self.manifest["num_passages"])
    self._sentences: collections.OrderedDict[int, _Sentences] = collections.OrderedDict()
    self._lock = threading.Lock()  # (the cache: searches may run in threads)

  @staticmethod
  def _check_columns(retriever) -> None:
    """Refuses bm25s's [passages, V] CSC scores whose columns (one per vocabulary term, but
    bm25s's empty term, last, which may have none) do not fit the vocabulary and the entries:
    a damaged file of the recorded size, which scoring would read silently."""
    indptr = np.asarray(retriever.scores["indptr"], np.int64)
    if (len(indptr) - 1 not in (len(retriever.vocab_dict), len(retriever.vocab_dict) - 1)
        or (np.diff(indptr) < 0).any() or indptr[-1] != len(retriever.scores["indices"])):
      raise ValueError("the score matrix's columns do not match the vocabulary")

  @staticmethod
  def _sentence_idf(frequency: np.ndarray, vocab: int, sentences: int) -> np.ndarray:
    """[V] float32 Lucene idf of each vocabulary term over the sentences, from its document
    frequency among them (`SENTENCE_DF`), checked against the vocabulary and sentence count."""
    if (frequency.shape != (vocab,) or frequency.dtype.kind != "u"
        or frequency.max(initial=0) > sentences):
      raise ValueError(f"{SENTENCE_DF} does not match the vocabulary and the sentences")
    frequency = frequency.astype(np.float64)
    return np.log1p((sentences - frequency + 0.5) / (frequency + 0.5)).astype(np.float32)

  def check_of(self, dump_dir: str | os.PathLike, dump_manifest: dict) -> None:
    """Refuses this BM25 index for a dump it was not built from (its id, model, passages)."""
    if (self.manifest.get("dump_id") != dump_manifest.get("dump_id", "")
        or self.manifest.get("fingerprint") != dump_manifest.get("fingerprint")
        or self.manifest.get("num_passages") != dump_manifest.get("num_passages")):
      raise DumpError(f"{self.directory} was built from another dump than the one in "
                      f"{pathlib.Path(dump_dir)} ({self.manifest.get('num_passages')} passages, "
                      f"dump {self.manifest.get('dump_id')!r}; the dump: "
                      f"{dump_manifest.get('num_passages')}, "
                      f"{dump_manifest.get('dump_id', '')!r}): {BUILD_HINT}")

  @property
  def weight(self) -> float | None:
    """The hybrid weight of passage BM25 recorded for this index (None: not chosen yet)."""
    return self.manifest.get("weight")

  @property
  def sentence_weight(self) -> float | None:
    """The hybrid weight of sentence BM25 recorded for this index (None: not chosen yet)."""
    return self.manifest.get("sentence_weight")

  def scores(self, texts: Sequence[str]) -> np.ndarray:
    """BM25 score of every passage for each text, [Q, passages] float32 (0: no shared term)."""
    out = np.zeros((len(texts), self.num_passages), np.float32)
    for row, terms in enumerate(tokenize(texts)):
      if terms:
        out[row] = self.retriever.get_scores(terms)
    return out

  def question_terms(self, texts: Sequence[str]) -> list[QuestionTerms]:
    """Each text's terms for `sentence_scores` (a term no passage holds is in no sentence)."""
    vocab, out = self.retriever.vocab_dict, []
    for terms in tokenize(texts):
      ids, counts = np.unique(np.array([vocab[t] for t in terms if t in vocab], np.int64),
                              return_counts=True)
      out.append(QuestionTerms(ids, self._idf[ids] * counts.astype(np.float32)))
    return out

  def sentence_scores(self, terms: QuestionTerms, rows: np.ndarray, chars: np.ndarray,
                      passages: Sequence) -> np.ndarray:
    """[N] float32 BM25 of a question (`question_terms`) against the sentence holding character
    `chars` [N] of each passage row `rows` [N] ("title sentence", `units.sentence_bounds`);
    `passages`: the dump's passages, which this index was built from."""
    rows, chars = np.asarray(rows, np.int64), np.asarray(chars, np.int64)
    if not len(terms.ids) or not len(rows):
      return np.zeros(len(rows), np.float32)
    # Candidates come in runs of one passage: the runs' first rows name every passage.
    heads = np.flatnonzero(np.concatenate([[True], rows[1:] != rows[:-1]]))
    missing = sorted(set(rows[heads].tolist()) - terms.scored)
    if missing:
      tokenized = self._tokenized(missing, passages)
      keys = np.concatenate([terms.keys] + [(row << 32) + sentences.starts
                                            for row, sentences in zip(missing, tokenized)])
      values = np.concatenate([terms.values, self._score(terms, tokenized)])
      order = np.argsort(keys, kind="stable")
      terms.keys, terms.values = keys[order], values[order]
      terms.scored.update(missing)
    # A character's sentence is the last of its passage starting at or before it.
    return terms.values[np.searchsorted(terms.keys, (rows << 32) + chars, "right") - 1]

  def _score(self, terms: QuestionTerms, tokenized: Sequence[_Sentences]) -> np.ndarray:
    """[sentences] float32 BM25 of the question against each sentence of `tokenized`, in
    order: sum over its terms of weight x tf / (tf + k1 (1 - b + b length / mean length))."""
    lengths = np.concatenate([s.lengths for s in tokenized])
    words = np.concatenate([s.terms for s in tokenized])
    sentence = np.repeat(np.arange(len(lengths)), lengths)
    at = np.minimum(np.searchsorted(terms.ids, words), len(terms.ids) - 1)
    hit = terms.ids[at] == words
    tf = np.bincount(sentence[hit] * len(terms.ids) + at[hit],
                     minlength=len(lengths) * len(terms.ids)).reshape(len(lengths), -1)
    k1, b = np.float32(SETTINGS["k1"]), np.float32(SETTINGS["b"])
    norm = k1 * (1 - b + b * lengths.astype(np.float32) / np.float32(self.sentence_length))
    out = np.zeros(len(lengths), np.float32)
    for j, weight in enumerate(terms.weights):  # term by term: one order, whatever the batch
      counts = tf[:, j].astype(np.float32)
      out += weight * (counts / (counts + norm))
    return out

  def _tokenized(self, rows: Sequence[int], passages: Sequence) -> list[_Sentences]:
    """The tokenized sentences of passage rows `rows`: from the cache, the others tokenized in
    one call and cached."""
    with self._lock:
      found = {row: self._sentences.get(row) for row in rows}
      for row, sentences in found.items():
        if sentences is not None:
          self._sentences.move_to_end(row)
    new = [row for row, sentences in found.items() if sentences is None]
    if new:
      found.update(zip(new, self._tokenize_passages([passages[row] for row in new])))
      with self._lock:
        for row in new:
          self._sentences[row] = found[row]
        while len(self._sentences) > SENTENCE_CACHE_PASSAGES:
          self._sentences.popitem(last=False)
    return [found[row] for row in rows]

  def _tokenize_passages(self, passages: Sequence) -> list[_Sentences]:
    """Each passage's sentences tokenized as the passages were, terms as vocabulary ids."""
    split = [sentence_texts(p) for p in passages]
    tokenized = term_ids([text for _, texts in split for text in texts],
                         self.retriever.vocab_dict)
    lengths = np.array([len(ids) for ids in tokenized], np.int32)
    words = np.fromiter((i for ids in tokenized for i in ids), np.int32,
                        count=int(lengths.sum()))
    out, sentence, word = [], 0, 0
    for starts, texts in split:
      mine = lengths[sentence:sentence + len(texts)]
      out.append(_Sentences(np.array(starts, np.int64), mine.copy(),
                            words[word:word + int(mine.sum())].copy()))
      sentence, word = sentence + len(texts), word + int(mine.sum())
    return out
