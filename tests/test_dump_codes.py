"""Dump-time filtering and coding (`index.dump_filter_threshold`, `index.dump_codec`,
`index.dump_vectors`; `dpjax.index.dump_codes`) on a copy of the tiny trained workdir: a codes dump
without vectors answers as the unfiltered dump's compact index with index-time filtering, a
filtered dump with vectors as its filtered Flat index; resumes; refusals."""
import pathlib
import shutil

import numpy as np
import pytest

from conftest import phrase_questions

import run
from dpjax.data.squad import Passage
from dpjax.errors import ConfigError, DumpError
from dpjax.index import dump_codes
from dpjax.index.dump_reader import Dump
from dpjax.index.faiss_index import build_index, index_folder
from dpjax.index.manifest import read_manifest, write_manifest
from dpjax.index.phrase_index import PhraseIndex
from dpjax.loading import save_filter_head

QUESTIONS = 37
CODEC = "PQ6x4"  # 5-d sub-vectors of the tiny model's 30, 16 centroids each


def _run(workdir, mode: str, *sets: str) -> int:
  args = [mode, "--config", "experiments/demo.py:tiny", "--workdir", str(workdir),
          "--set", "index.shard_passages=7"]  # the tiny corpus's 30 passages in 5 shards
  for item in sets:
    args += ["--set", item]
  return run.main(args)


@pytest.fixture(scope="module")
def workdir(tiny_workdir, tmp_path_factory) -> pathlib.Path:
  """A copy of the tiny workdir with a seeded filter head (the tiny model's gives every token
  the same logit) and three dumps: `full` (float16, every token), `codes` (the tokens the
  threshold keeps, PQ codes only) and `kept` (those tokens' float16 vectors)."""
  workdir = tmp_path_factory.mktemp("codes") / "demo"
  shutil.copytree(tiny_workdir, workdir, ignore=shutil.ignore_patterns("dump"))
  rng = np.random.default_rng(5)
  dim = read_manifest(tiny_workdir / "dump")["dim"]
  save_filter_head(workdir, rng.normal(0, 1, (dim, 2)).astype(np.float32),
                   np.zeros(2, np.float32))
  assert _run(workdir, "dump", "index.dump_name=full") == 0
  logits = Dump.load(workdir / "full").filter_logits.astype(np.float32).max(1)
  threshold = float(np.median(logits))
  (workdir / "threshold").write_text(repr(threshold))
  assert _run(workdir, "dump", "index.dump_name=codes", f"index.dump_codec={CODEC}",
              "index.dump_vectors=False", f"index.dump_filter_threshold={threshold!r}") == 0
  assert _run(workdir, "dump", "index.dump_name=kept",
              f"index.dump_filter_threshold={threshold!r}") == 0
  build_index(workdir / "full", f"compact:{CODEC}", filter_threshold=threshold)
  build_index(workdir / "full", "Flat", filter_threshold=threshold)
  build_index(workdir / "codes", "compact")
  build_index(workdir / "kept", "Flat")
  return workdir


def _threshold(workdir) -> float:
  return float((workdir / "threshold").read_text())


def _questions(workdir):
  """Question vectors made of the full dump's token vectors (`phrase_questions`)."""
  return phrase_questions(Dump.load(workdir / "full").vectors, QUESTIONS, 11)


def _top(index: PhraseIndex, q_start, q_end, k: int = 5):
  return [[(p.text, p.score, p.passage) for p, _ in units]
          for units in index.search(q_start, q_end, k)]


def test_a_codes_dump_holds_the_kept_tokens_codes_and_no_vectors(workdir):
  codes, full = read_manifest(workdir / "codes"), read_manifest(workdir / "full")
  assert codes["context_tokens"] == full["num_tokens"] > codes["num_tokens"] > 0
  assert codes["codec"]["spec"] == CODEC and (workdir / "codes" / "codec.faiss").is_file()
  assert not list((workdir / "codes").glob("shard_*/vectors.npy"))
  assert len(list((workdir / "codes").glob("shard_*/codes.npy"))) == len(codes["shards"]) == 5
  assert codes["bytes_per_token"] < full["bytes_per_token"] / 4


def test_a_codes_dump_answers_as_the_full_dumps_compact_index(workdir):
  """The same codec (trained on the same kept tokens), codes, spans, offsets and kept bits."""
  threshold = _threshold(workdir)
  full_dir = workdir / "full" / "indexes" / index_folder(f"compact:{CODEC}", threshold)
  codes_dir = workdir / "codes" / "indexes" / "compact"
  parts = sorted(p.name for p in full_dir.iterdir() if p.suffix in (".npy", ".faiss"))
  assert "codec.faiss" in parts and "codes.npy" in parts
  assert parts == sorted(p.name for p in codes_dir.iterdir() if p.suffix in (".npy", ".faiss"))
  for part in parts:
    assert (full_dir / part).read_bytes() == (codes_dir / part).read_bytes(), part
  q_start, q_end = _questions(workdir)
  want = _top(PhraseIndex(workdir / "full", full_dir.name), q_start, q_end)
  assert _top(PhraseIndex(workdir / "codes", "compact", verify=True), q_start, q_end) == want
  assert sum(map(len, want)) > QUESTIONS


def test_dump_time_filtering_answers_as_index_time_filtering(workdir):
  q_start, q_end = _questions(workdir)
  want = _top(PhraseIndex(workdir / "full", index_folder("Flat", _threshold(workdir))),
              q_start, q_end)
  assert _top(PhraseIndex(workdir / "kept", "Flat"), q_start, q_end) == want


def test_a_killed_codes_dump_resumes_by_shard_to_the_same_files(workdir, tmp_path):
  """The last shard deleted and the manifest marked incomplete (a kill before the end): the
  rerun encodes that shard only, with the codec it trained before."""
  copy = tmp_path / "demo"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("full", "kept", "indexes"))
  manifest = read_manifest(copy / "codes")
  last = copy / "codes" / manifest["shards"][-1]["name"]
  before = _files(last)
  codec = (copy / "codes" / "codec.faiss").stat().st_mtime_ns
  shutil.rmtree(last)
  write_manifest(copy / "codes", {**manifest, "complete": False, "shards": []})
  assert _run(copy, "dump", "index.dump_name=codes", f"index.dump_codec={CODEC}",
              "index.dump_vectors=False",
              f"index.dump_filter_threshold={_threshold(workdir)!r}") == 0
  assert _files(last) == before
  assert (copy / "codes" / "codec.faiss").stat().st_mtime_ns == codec
  assert read_manifest(copy / "codes")["dump_id"] == manifest["dump_id"]


def _files(folder: pathlib.Path) -> dict[str, bytes]:
  """A shard's files (not the verification stamp a load leaves)."""
  return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")}


def test_the_codecs_passages_are_a_seeded_sample_across_the_corpus():
  """A read takes the passages of the smallest keys whose texts hold the characters asked, from
  the whole corpus (not its start), in corpus order, the same every time; the next read takes
  the following keys; a budget past the corpus takes it all, in order."""
  corpus = [Passage(f"p{i}", "", "x" * (3 + i % 11)) for i in range(997)]
  taken, largest, complete = dump_codes.sample_passages(corpus, 400)
  places = [place for place, _ in taken]
  assert places == sorted(places) and not complete and 0 < largest < 1
  assert 400 <= sum(len(p.text) for _, p in taken) < 400 + 13  # (no text is longer than 13)
  assert min(places) < 250 and max(places) > 750  # spread over the corpus
  assert [p for _, p in taken] == [corpus[i] for i in places]
  assert dump_codes.sample_passages(corpus, 400) == (taken, largest, complete)
  more, larger, _ = dump_codes.sample_passages(corpus, 400, above=largest)
  assert not {place for place, _ in more} & set(places) and larger > largest
  everything, _, complete = dump_codes.sample_passages(corpus, 10 ** 6)
  assert complete and [p for _, p in everything] == corpus


def test_a_codes_dump_samples_its_codec_across_the_corpus_and_again_the_same(workdir, tmp_path):
  """index.train_size below the kept tokens: the codec's sample is passages of several shards,
  not all of them; a dump killed before the codec was recorded trains the same codec again
  from the same sample, and one killed after reuses it."""
  copy = tmp_path / "demo"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("full", "kept", "codes"))
  sets = ("index.dump_name=small", f"index.dump_codec={CODEC}", "index.dump_vectors=False",
          f"index.dump_filter_threshold={_threshold(workdir)!r}", "index.train_size=300")
  assert _run(copy, "dump", *sets) == 0
  manifest = read_manifest(copy / "small")
  record = manifest["codec"]
  assert record["train_tokens"] == 300 <= record["sample"]["kept_tokens"]
  assert 1 < record["sample"]["shards"] and record["sample"]["passages"] < 30
  codec = (copy / "small" / "codec.faiss").read_bytes()
  first = _files(copy / "small" / manifest["shards"][0]["name"])
  for shard in manifest["shards"]:
    shutil.rmtree(copy / "small" / shard["name"])
  write_manifest(copy / "small", {key: value for key, value in manifest.items()
                                  if key != "codec"} | {"complete": False, "shards": []})
  assert _run(copy, "dump", *sets) == 0
  assert (copy / "small" / "codec.faiss").read_bytes() == codec
  assert read_manifest(copy / "small")["codec"] == record
  assert _files(copy / "small" / manifest["shards"][0]["name"]) == first


def test_what_needs_vectors_is_refused_on_a_codes_dump(workdir):
  with pytest.raises(DumpError, match="index.dump_vectors"):
    build_index(workdir / "codes", "Flat")
  with pytest.raises(DumpError, match="index.dump_vectors"):
    Dump.load(workdir / "codes")
  with pytest.raises(ConfigError, match="index.dump_codec"):
    build_index(workdir / "codes", "compact:SQ8")
  # a residual code is coded from the vectors (the dump's codes are of the tokens themselves)
  with pytest.raises(DumpError, match="index.dump_vectors"):
    build_index(workdir / "codes", "compact:pr:PQ5")
  assert not (workdir / "codes" / "indexes" / "compact_pr_PQ5").exists()
  assert _run(workdir, "index", "index.dump_name=codes", 'index.specs=["Flat"]') == 2
  assert _run(workdir, "subcorpus", "index.dump_name=codes") == 2


def test_verify_checks_the_dumps_codec(workdir, tmp_path):
  copy = tmp_path / "demo"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("full", "kept"))
  assert _run(copy, "verify") == 0
  codec = copy / "codes" / "codec.faiss"
  data = bytearray(codec.read_bytes())
  data[-1] ^= 1
  codec.write_bytes(bytes(data))
  assert _run(copy, "verify") == 2


@pytest.mark.parametrize("sets", [("index.dump_vectors=False",),
                                  ("index.dump_codec=IVF4,PQ6",),
                                  ("index.dump_codec=PQ7", "index.dump_vectors=False")])
def test_codec_settings_that_cannot_work_are_refused(workdir, tmp_path, sets):
  """No codec for a dump without vectors, a codec of no flat codes, one faiss cannot make for
  30-d vectors (7 sub-vectors): one line, exit 2, nothing written."""
  assert _run(workdir, "dump", f"index.dump_name={tmp_path.name}", *sets) == 2
  assert not (workdir / tmp_path.name).exists()


def test_a_threshold_keeping_no_sampled_token_is_refused_before_any_shard(workdir, tmp_path):
  name = f"none_{tmp_path.name}"
  assert _run(workdir, "dump", f"index.dump_name={name}", f"index.dump_codec={CODEC}",
              "index.dump_filter_threshold=60000.0") == 2
  assert not (workdir / name).exists()  # (no manifest left for a later run to trip on)


def test_a_full_disk_is_refused_before_the_shard_is_written(workdir, tmp_path, monkeypatch,
                                                            caplog):
  name = f"disk_{tmp_path.name}"
  monkeypatch.setattr(dump_codes.shutil, "disk_usage",
                      lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
  assert _run(workdir, "dump", f"index.dump_name={name}", "index.dump_codec=SQfp16") == 2
  assert "MiB free" in caplog.text
  assert not (workdir / name).exists()
