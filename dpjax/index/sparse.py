"""The BM25 index of a dump's passages, the lexical half of hybrid search.

BM25 as the project's BM25 peer computes it (experiments/benchmarks/passage_retrieval.py):
bm25s with k1 0.9 and b 0.4 (Pyserini's defaults), English stop words and the Snowball English
stemmer of PyStemmer, over "title text" of each passage; and the same BM25 over "title sentence"
of each sentence of each passage (`units.sentence_bounds`, the sentence unit's sentences), whose
score hybrid search adds for the sentence a phrase starts in. It is written into
`<dump>/indexes/bm25/` beside the faiss indexes, through a temporary folder renamed when
complete, with a manifest that names the dump it was built from (refused against any other),
each file's size and digest, and the hybrid weights chosen for it (`record_weight`).
"""
from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import Sequence

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
            "sentences": "title sentence (units.sentence_bounds), in folder sentences/"}
SENTENCES = "sentences"  # the sentences' BM25, a subfolder
_SENTENCE_ROWS = "sentence_rows.npy"  # [S, 2]: each sentence's passage row and first character
_CHAR_SHIFT = np.int64(1) << 32  # passage row x shift + character: a sentence's sort key
BUILD_HINT = "build it with `run.py index --set index.sparse=True`"


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


def tokenize(texts: Sequence[str], *, ids: bool = False):
  """Stemmed terms of each text, as the index's passages were tokenized (`ids`: bm25s's
  vocabulary and ids, what an index is built from)."""
  bm25s, stemmer = _bm25s()
  return bm25s.tokenize(list(texts), stopwords=SETTINGS["stopwords"], stemmer=stemmer,
                        return_ids=ids, show_progress=False)


def passage_text(passage) -> str:
  """What BM25 indexes of a passage: "title text"."""
  return f"{passage.title} {passage.text}"


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
  sentences, rows = _sentences(passages)
  tmp = final.with_name(final.name + ".tmp")
  remove(tmp)
  tmp.mkdir(parents=True)
  try:
    retriever.save(str(tmp), show_progress=False)
    bm25_of(sentences).save(str(tmp / SENTENCES), show_progress=False)
    np.save(tmp / _SENTENCE_ROWS, rows)
    files = folder_checksums(tmp)
    manifest = {"kind": "bm25", "settings": SETTINGS, "num_passages": len(texts),
                "num_sentences": len(sentences),
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


def _sentences(passages: Sequence) -> tuple[list[str], np.ndarray]:
  """("title sentence" of every sentence of every passage, in order; [S, 2] int64 rows of
  (passage row, first character))."""
  texts, rows = [], []
  for row, passage in enumerate(passages):
    bounds = sentence_bounds(passage.text)
    for start, end in zip(bounds[:-1], bounds[1:]):
      texts.append(f"{passage.title} {passage.text[start:end]}")
      rows.append((row, start))
  return texts, np.array(rows, np.int64).reshape(-1, 2)


def record_weight(dump_dir: str | os.PathLike, weight: float, sentence_weight: float,
                  tuning: dict) -> None:
  """Records the hybrid weights (passage and sentence BM25) and how they were chosen in the BM25
  index's manifest."""
  path = sparse_folder(dump_dir) / MANIFEST
  manifest = read_json(path, DumpError, BUILD_HINT)
  manifest.update(weight=float(weight), sentence_weight=float(sentence_weight),
                  weight_tuning=tuning)
  write_json(path, manifest)


class SparseIndex:
  """A dump's BM25 index, checked against the dump: `scores(texts)` gives every passage's BM25
  score for each question, `sentence_scores(texts)` every sentence's."""

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
    if "num_sentences" not in self.manifest:
      raise DumpError(f"{self.directory}: a BM25 index without its sentences (made by an older "
                      f"dpjax); {BUILD_HINT}")
    if self.manifest.get("settings") != SETTINGS:
      raise DumpError(f"{self.directory}: a BM25 index of other settings "
                      f"({self.manifest.get('settings')}); {BUILD_HINT}")
    bm25s, _ = _bm25s()
    try:
      self.retriever = bm25s.BM25.load(str(self.directory), show_progress=False)
      self.sentence_retriever = bm25s.BM25.load(str(self.directory / SENTENCES),
                                                show_progress=False)
      rows = np.load(self.directory / _SENTENCE_ROWS)
    except (OSError, ValueError, KeyError, EOFError) as e:  # damaged, its sizes unchanged
      reason = (str(e).splitlines() or [""])[0][:200]
      raise DumpError(f"{self.directory}: the BM25 index is unreadable ({type(e).__name__}: "
                      f"{reason}); {BUILD_HINT}") from None
    self.num_passages = int(self.manifest["num_passages"])
    self.num_sentences = int(self.manifest["num_sentences"])
    self._sentence_keys = self._keys_of(rows)  # by passage, then first character

  def _keys_of(self, rows: np.ndarray) -> np.ndarray:
    """The sort keys of the sentence table's rows (`sentence_rows`), refused unless it holds
    `num_sentences` rows in order, each passage's first sentence at its character 0."""
    ok = rows.shape == (self.num_sentences, 2)
    if ok:
      keys = rows[:, 0] * _CHAR_SHIFT + rows[:, 1]
      ok = bool((np.diff(keys) > 0).all()) and np.array_equal(rows[rows[:, 1] == 0, 0],
                                                             np.arange(self.num_passages))
    if not ok:
      raise DumpError(f"{self.directory / _SENTENCE_ROWS}: not the index's sentences in order; "
                      f"{BUILD_HINT}")
    return keys

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
    return _scores(self.retriever, self.num_passages, texts)

  def sentence_scores(self, texts: Sequence[str]) -> np.ndarray:
    """BM25 score of every sentence for each text, [Q, sentences] float32."""
    return _scores(self.sentence_retriever, self.num_sentences, texts)

  def sentence_rows(self, passages: np.ndarray, chars: np.ndarray) -> np.ndarray:
    """The sentence (row of `sentence_scores`) holding character `chars` of passage rows
    `passages`, as `units.sentence_bounds` splits the passage."""
    keys = np.asarray(passages, np.int64) * _CHAR_SHIFT + np.asarray(chars, np.int64)
    return np.searchsorted(self._sentence_keys, keys, "right") - 1


def _scores(retriever, width: int, texts: Sequence[str]) -> np.ndarray:
  out = np.zeros((len(texts), width), np.float32)
  for row, terms in enumerate(tokenize(texts)):
    if terms:
      out[row] = retriever.get_scores(terms)
  return out
