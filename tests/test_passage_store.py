"""A compact index's passage store: written a block at a time, read back lazily, refused when
damaged."""
import threading

import numpy as np
import pytest

from dpjax.data.squad import Passage
from dpjax.errors import DumpError
from dpjax.index import passage_store
from dpjax.index.passage_store import PassageStore, document_digest, write_passages
from dpjax.index.units import document_key

BLOCK = 97  # field bytes a test block holds (odd, small: many blocks)


def _passages() -> list[Passage]:
  """Odd passages: unicode of every width, empty fields, a newline, and one longer than a
  block."""
  found = [Passage(str(i), f"Title {i % 5}", f"text {i} " * (i % 7)) for i in range(53)]
  found[3] = Passage("3", "", "")  # untitled and empty
  found[11] = Passage("ünï", "Ωmega 北京", "naïve café 😀 — 北京\nline two\x00")
  found[20] = Passage("20", "Long", "x" * (5 * BLOCK) + "é")
  found[21] = Passage("Title 1", "", "an untitled passage whose id is another's title")
  return found


@pytest.fixture
def store(tmp_path):
  passages = _passages()
  write_passages(tmp_path, passages, len(passages), block_bytes=BLOCK)
  return tmp_path, passages


def test_the_store_gives_back_every_passage(store):
  directory, passages = store
  read = PassageStore(directory, len(passages), cache_blocks=2)
  assert len(read) == len(passages)
  assert list(read) == passages  # iteration
  assert [read[i] for i in range(len(passages))] == passages  # one at a time (through the cache)
  assert [read[i] for i in reversed(range(len(passages)))] == passages[::-1]
  assert read[-1] == passages[-1] and read[np.int64(11)] == passages[11]
  assert read[5:9] == passages[5:9] and read[::-7] == passages[::-7]
  with pytest.raises(IndexError):
    read[len(passages)]
  blocks = np.load(directory / passage_store.BLOCKS)
  assert blocks.shape[1] - 1 > 10  # many blocks: the test crosses their bounds
  # the long passage is a block alone
  assert 20 in blocks[1] and 21 in blocks[1]


def test_documents_are_one_digest_per_document_key(store):
  directory, passages = store
  documents = PassageStore(directory, len(passages)).documents
  assert documents.dtype == np.int64 and documents.shape == (len(passages),)
  assert list(documents) == [document_digest(p) for p in passages]
  keys = [document_key(p) for p in passages]
  for i in range(len(passages)):
    for j in range(len(passages)):
      assert (documents[i] == documents[j]) == (keys[i] == keys[j]), (i, j)


def test_an_empty_store_and_reads_from_threads(tmp_path):
  write_passages(tmp_path, [], 0)
  assert len(PassageStore(tmp_path, 0)) == 0 and list(PassageStore(tmp_path, 0)) == []
  many = [Passage(str(i), "t", f"passage {i}") for i in range(401)]
  write_passages(tmp_path, many, len(many), block_bytes=BLOCK)
  read, errors = PassageStore(tmp_path, len(many), cache_blocks=3), []

  def check(offset):
    for i in range(offset, len(many), 5):
      if read[i] != many[i]:
        errors.append(i)

  threads = [threading.Thread(target=check, args=(n,)) for n in range(5)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not errors


def test_other_counts_are_refused(store, tmp_path):
  directory, passages = store
  with pytest.raises(DumpError, match="passage_blocks.npy: not the blocks of 52 passages"):
    PassageStore(directory, len(passages) - 1)
  with pytest.raises(DumpError, match="3 passages written, 4 in the dump's manifest"):
    write_passages(tmp_path / ".", passages[:3], 4)
  with pytest.raises(DumpError, match="more than the 2 passages"):
    write_passages(tmp_path, passages[:3], 2)


def test_a_damaged_block_is_refused_in_one_line(store):
  directory, passages = store
  path = directory / passage_store.DATA
  data = bytearray(path.read_bytes())
  blocks = np.load(directory / passage_store.BLOCKS)
  start, end = blocks[0, 2], blocks[0, 3]
  data[start:end] = bytes(end - start)  # the third block zeroed
  path.write_bytes(bytes(data))
  read = PassageStore(directory, len(passages))
  assert read[0] == passages[0]  # (other blocks read)
  with pytest.raises(DumpError, match=r"passages.bin: block 2 .* is damaged") as e:
    read[int(blocks[1, 2])]
  assert "\n" not in str(e.value)
  path.write_bytes(bytes(data[:-3]))  # truncated
  with pytest.raises(DumpError, match="passage_blocks.npy: not the blocks"):
    PassageStore(directory, len(passages))
