"""The compact index kind (`compact:<codec>`) on the tiny trained workdir's dump: built from the
dump, searched without the dump's token arrays or passages, its answers against the Flat
index's."""
import copy
import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from conftest import phrase_questions

from dpjax.errors import ConfigError, DumpError
from dpjax.index import hybrid, passage_store
from dpjax.index.dump_reader import TOKEN_ARRAYS
from dpjax.index.faiss_index import build_index, index_problems
from dpjax.index.manifest import read_manifest, write_manifest
from dpjax.index.passage_store import PassageStore
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.rescoring import TokenPassages
from dpjax.index.shards import record_rewrite

QUESTIONS = 61


THRESHOLD = 0.0  # the fixture's filter logits keep about half the tokens at it


@pytest.fixture(scope="module")
def dump(tiny_workdir, tmp_path_factory):
  """A copy of the tiny workdir's dump with seeded filter logits, a filtered Flat index and
  compact indexes."""
  directory = tmp_path_factory.mktemp("compact") / "dump"
  shutil.copytree(tiny_workdir / "dump", directory)
  _random_filter_logits(directory)
  for spec, filtered in (("Flat", True), ("compact:SQfp16", False), ("compact:SQfp16", True),
                         ("compact:PQ6", False)):
    build_index(directory, spec, filter_threshold=THRESHOLD if filtered else None)
  return directory


def _random_filter_logits(directory) -> None:
  """Seeded normal filter logits (the tiny model's head gives every token 0), recorded in the
  shards' and the manifest's digests as `run.py filter` records its own."""
  manifest, rng = read_manifest(directory), np.random.default_rng(3)
  for shard in manifest["shards"]:
    path = directory / shard["name"] / "filter_logits.npy"
    np.save(path, rng.normal(0, 1, np.load(path).shape).astype(np.float16))
    record_rewrite(path.parent, shard, path.name)
  write_manifest(directory, manifest)


def _questions(flat: PhraseIndex):
  """Question vectors made of the dump's own token vectors (`phrase_questions`)."""
  return phrase_questions(flat.dump.vectors, QUESTIONS, 7)


def _vectorless(directory, tmp_path):
  """A copy of the dump without any shard's token arrays (vectors, logits, token passages,
  spans) or passages (passages.jsonl)."""
  copy = tmp_path / "dump"
  dropped = {f"{key}.npy" for key in TOKEN_ARRAYS} | {"passages.jsonl"}
  shutil.copytree(directory, copy, ignore=lambda folder, names: [
      n for n in names if n in dropped and pathlib.Path(folder).name.startswith("shard_")])
  assert not list(copy.glob("shard_*/vectors.npy")) + list(copy.glob("shard_*/passages.jsonl"))
  return copy


def _top(index: PhraseIndex, q_start, q_end, k: int = 5, unit: str = "phrase"):
  return [[(p.text, p.score, p.passage) for p, _ in units]
          for units in index.search(q_start, q_end, k, unit)]


def test_a_float16_code_answers_as_the_flat_index_with_no_dump_vectors(dump, tmp_path):
  flat = PhraseIndex(dump, "Flat")
  q_start, q_end = _questions(flat)
  compact = PhraseIndex(_vectorless(dump, tmp_path), "compact:SQfp16", verify=True)
  assert compact.dump.vectors.size == 0 and compact.manifest["num_tokens"] == len(
      flat.dump.vectors)
  # The codes are the dump's float16 values: the rescored phrases are the Flat index's, exactly,
  # with the index's own passages (the dump's passages.jsonl are gone).
  for unit in ("phrase", "sentence", "passage", "document"):
    assert _top(compact, q_start, q_end, unit=unit) == _top(flat, q_start, q_end, unit=unit), unit
  assert isinstance(compact.dump.passages, PassageStore)
  assert list(compact.dump.passages) == flat.dump.passages
  found = compact.search(q_start[:1], q_end[:1], 1)[0][0][0]
  assert compact.result(found) == flat.result(found) and found.text


def test_a_filtered_compact_index_answers_as_the_filtered_flat_index(dump, tmp_path):
  flat = PhraseIndex(dump, f"Flat_filter{THRESHOLD:g}")
  compact = PhraseIndex(_vectorless(dump, tmp_path), f"compact_SQfp16_filter{THRESHOLD:g}")
  assert 0 < compact.manifest["num_tokens"] == flat.manifest["num_tokens"] < len(
      flat.dump.vectors)
  q_start, q_end = _questions(PhraseIndex(dump, "Flat"))
  assert _top(compact, q_start, q_end) == _top(flat, q_start, q_end)
  # Its token ids are ranks among the kept tokens; `token_ids` maps them to the dump's.
  ours = compact.search(q_start, q_end, 1)
  theirs = flat.search(q_start, q_end, 1)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(compact.compact.token_ids([a[0][0].start_token,
                                                             a[0][0].end_token]),
                                  [b[0][0].start_token, b[0][0].end_token])


def test_hybrid_searchs_exhaustive_spans_are_the_flat_indexs(dump, tmp_path):
  for flat_name, compact_name in (("Flat", "compact:SQfp16"),
                                  (f"Flat_filter{THRESHOLD:g}",
                                   f"compact_SQfp16_filter{THRESHOLD:g}")):
    flat, compact = PhraseIndex(dump, flat_name), PhraseIndex(dump, compact_name)
    q_start, q_end = _questions(PhraseIndex(dump, "Flat"))
    rows = [np.array([0, 3, 5]), np.array([2]), np.array([], np.int64)]
    ours = hybrid.lexical_spans(compact.rescorer, q_start[:3], q_end[:3], rows, 10)
    theirs = hybrid.lexical_spans(flat.rescorer, q_start[:3], q_end[:3], rows, 10)
    for (s, e, x), (s2, e2, x2) in zip(ours, theirs):
      np.testing.assert_array_equal(x, x2)
      np.testing.assert_array_equal(compact.compact.token_ids(s), s2)
      np.testing.assert_array_equal(compact.compact.token_ids(e), e2)


def test_a_pq_code_agrees_with_the_flat_index_and_is_small(dump):
  flat, compact = PhraseIndex(dump, "Flat"), PhraseIndex(dump, "compact:PQ6")
  q_start, q_end = _questions(flat)
  agree = np.mean([a[0][0] == b[0][0] for a, b in zip(_top(compact, q_start, q_end),
                                                     _top(flat, q_start, q_end))])
  assert agree >= 0.6, agree
  manifest = compact.manifest
  assert manifest["parts"]["codes.npy"]["per_token"] == pytest.approx(
      6 + 128 / manifest["num_tokens"], abs=0.01)  # 6 bytes a token and the .npy header
  assert manifest["index_bytes"] == sum(p["bytes"] for p in manifest["parts"].values())
  assert not index_problems(compact.compact.directory, manifest, contents=True)


def test_damaged_codes_are_refused_in_one_line(dump, tmp_path):
  copy = tmp_path / "dump"
  shutil.copytree(dump, copy)
  codes = copy / "indexes/compact_PQ6/codes.npy"
  data = codes.read_bytes()
  codes.write_bytes(data[:128] + bytes(len(data) - 128))  # zeroed, same size
  PhraseIndex(copy, "compact:PQ6")  # (sizes only: the damage is not seen)
  with pytest.raises(DumpError, match="codes.npy: its bytes differ") as e:
    PhraseIndex(copy, "compact:PQ6", verify=True)
  assert "\n" not in str(e.value)
  codes.write_bytes(data[:-8])  # truncated
  with pytest.raises(DumpError, match="codes.npy: .* bytes, .* when it was written"):
    PhraseIndex(copy, "compact:PQ6")


def test_an_index_of_another_dump_is_refused(dump, tmp_path):
  copy = tmp_path / "dump"
  shutil.copytree(dump, copy)
  manifest = json.loads((copy / "manifest.json").read_text())
  (copy / "manifest.json").write_text(json.dumps({**manifest, "dump_id": "another"}))
  with pytest.raises(DumpError, match="built from another dump"):
    PhraseIndex(copy, "compact:PQ6")


@pytest.mark.parametrize("spec, threshold, error, message", [
    ("compact:PQ6", 1e4, DumpError, "no token passes the filter threshold"),
    ("compact:IVF4,PQ6", None, ConfigError, "a codec of flat codes"),
    ("compact:NotACodec", None, ConfigError, "not a faiss index factory string"),
])
def test_a_compact_index_that_cannot_be_built_leaves_nothing(dump, tmp_path, spec, threshold,
                                                             error, message):
  copy = tmp_path / "dump"
  shutil.copytree(dump, copy)
  before = sorted(p.name for p in (copy / "indexes").iterdir())
  with pytest.raises(error, match=message):
    build_index(copy, spec, filter_threshold=threshold)
  assert sorted(p.name for p in (copy / "indexes").iterdir()) == before


def _in_memory(index: PhraseIndex) -> PhraseIndex:
  """The compact index with every memory-mapped part copied into memory."""
  loaded = copy.copy(index)
  part = index.compact
  loaded.compact = dataclasses.replace(part, **{
      name: None if getattr(part, name) is None else np.array(getattr(part, name))
      for name in ("codes", "char_spans", "positions", "passage_offsets", "kept_offsets")})
  loaded.dump = dataclasses.replace(index.dump, token_passage=loaded.compact.token_passage,
                                    char_spans=loaded.compact.char_spans)
  loaded.index, loaded.rescorer = loaded.compact.searcher(), loaded.compact.rescorer()
  return loaded


@pytest.mark.parametrize("name", [f"compact_SQfp16_filter{THRESHOLD:g}", "compact_PQ6"])
def test_the_memory_mapped_index_answers_as_one_in_memory(dump, name):
  mapped = PhraseIndex(dump, name)
  q_start, q_end = _questions(PhraseIndex(dump, "Flat"))
  loaded = _in_memory(mapped)
  assert not isinstance(loaded.compact.codes, np.memmap)
  assert _top(loaded, q_start, q_end) == _top(mapped, q_start, q_end)


def test_loading_builds_no_array_of_one_entry_per_token(dump, tmp_path):
  """Every array of a token count's length is a memory map; a passage row's tokens come from
  offsets, not from an array of every token's passage."""
  index = PhraseIndex(_vectorless(dump, tmp_path), f"compact_SQfp16_filter{THRESHOLD:g}")
  kept, tokens = index.manifest["num_tokens"], index.manifest["dump_tokens"]
  assert kept < tokens
  assert isinstance(index.dump.token_passage, TokenPassages)
  assert isinstance(index.rescorer.token_passage, TokenPassages)
  assert index.rescorer.kept_mask is None and index.compact.positions.dtype == np.uint16
  arrays = 0
  for owner in (index, index.dump, index.compact, index.rescorer, index.rescorer.vectors):
    for name, value in vars(owner).items():
      if isinstance(value, np.ndarray) and value.ndim and len(value) in (kept, tokens):
        assert isinstance(value, np.memmap), name
        arrays += 1
  assert arrays >= 4  # codes, spans, positions: mapped
  assert not (index.compact.directory / "kept.npy").exists()
  assert set(index.manifest["parts"]) == {
      "codes.npy", "char_spans.npy", "positions.npy", "passage_offsets.npy", "kept_offsets.npy",
      *passage_store.FILES, "codec.faiss"}


def test_damaged_passages_are_refused_in_one_line(dump, tmp_path):
  copy_dir = tmp_path / "dump"
  shutil.copytree(dump, copy_dir)
  path = copy_dir / "indexes/compact_PQ6" / passage_store.DATA
  data = path.read_bytes()
  path.write_bytes(bytes(len(data)))  # zeroed, same size
  index = PhraseIndex(copy_dir, "compact:PQ6")  # (sizes only: the damage is seen when read)
  with pytest.raises(DumpError, match="passages.bin: block 0 .* is damaged") as e:
    index.dump.passages[0]
  assert "\n" not in str(e.value)
  with pytest.raises(DumpError, match="passages.bin: its bytes differ") as e:
    PhraseIndex(copy_dir, "compact:PQ6", verify=True)
  assert "\n" not in str(e.value)
  path.write_bytes(data[:-8])  # truncated
  with pytest.raises(DumpError, match="passages.bin: .* bytes, .* when it was written") as e:
    PhraseIndex(copy_dir, "compact:PQ6")
  assert "\n" not in str(e.value)


def test_a_compact_index_of_the_older_layout_is_refused(dump, tmp_path):
  copy_dir = tmp_path / "dump"
  shutil.copytree(dump, copy_dir)
  path = copy_dir / "indexes/compact_PQ6/index_manifest.json"
  manifest = json.loads(path.read_text())
  del manifest["parts"][passage_store.DATA]
  path.write_text(json.dumps(manifest))
  with pytest.raises(DumpError, match="older layout .* build the index again"):
    PhraseIndex(copy_dir, "compact:PQ6")
