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
from dpjax.main import open_workdir
from dpjax.main.index import question_weighting

QUESTIONS = 37
CODEC = "PQ6x4"  # 5-d sub-vectors of the tiny model's 30, 16 centroids each
RESIDUAL = f"qw+pr:{CODEC}"  # the same codes of the question-weighted passage residuals


def _run(workdir, mode: str, *sets: str) -> int:
  args = [mode, "--config", "experiments/demo.py:tiny", "--workdir", str(workdir),
          "--set", "index.shard_passages=7"]  # the tiny corpus's 30 passages in 5 shards
  for item in sets:
    args += ["--set", item]
  return run.main(args)


@pytest.fixture(scope="module")
def workdir(tiny_workdir, tmp_path_factory) -> pathlib.Path:
  """A copy of the tiny workdir with a seeded filter head (the tiny model's gives every token
  the same logit) and four dumps: `full` (float16, every token), `codes` (the tokens the
  threshold keeps, PQ codes only), `residual` (their residual codes, `RESIDUAL`) and `kept`
  (their float16 vectors)."""
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
  assert _run(workdir, "dump", "index.dump_name=residual", f"index.dump_codec={RESIDUAL}",
              "index.dump_vectors=False", f"index.dump_filter_threshold={threshold!r}") == 0
  assert _run(workdir, "dump", "index.dump_name=kept",
              f"index.dump_filter_threshold={threshold!r}") == 0
  build_index(workdir / "full", f"compact:{CODEC}", filter_threshold=threshold)
  settings, opened, _, _ = open_workdir("experiments/demo.py:tiny", workdir,
                                       ["index.dump_name=full"])
  build_index(workdir / "full", f"compact:{RESIDUAL}", filter_threshold=threshold,
              weighting=question_weighting(settings, opened))
  build_index(workdir / "residual", "compact")
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


def test_a_residual_codes_dump_answers_as_the_full_dumps_residual_index(workdir):
  """The dump's residual codes ("qw+pr:"): the same weighting (the model's training
  questions), means and residual codecs (trained on the same draw of kept tokens: the tiny
  corpus is its whole sample), codes and means codes as the index coded from the full dump's
  vectors; nothing of the vectors on disk."""
  full_dir = workdir / "full" / "indexes" / index_folder(f"compact:{RESIDUAL}", _threshold(workdir))
  codes_dir = workdir / "residual" / "indexes" / "compact"
  parts = sorted(p.name for p in full_dir.iterdir() if p.suffix in (".npy", ".faiss"))
  assert {"weighting.npy", "passage_means.npy", "means_codec.faiss", "codes.npy"} <= set(parts)
  assert parts == sorted(p.name for p in codes_dir.iterdir() if p.suffix in (".npy", ".faiss"))
  for part in parts:
    assert (full_dir / part).read_bytes() == (codes_dir / part).read_bytes(), part
  record = read_manifest(workdir / "residual")["codec"]
  assert record["spec"] == RESIDUAL and record["means_codec"] == "SQfp16"
  assert sorted(record["files"]) == ["means_codec.faiss", "weighting.npy"]
  assert not list((workdir / "residual").glob("shard_*/vectors.npy"))
  q_start, q_end = _questions(workdir)
  want = _top(PhraseIndex(workdir / "full", full_dir.name), q_start, q_end)
  assert _top(PhraseIndex(workdir / "residual", "compact", verify=True), q_start, q_end) == want
  assert sum(map(len, want)) > QUESTIONS


@pytest.mark.parametrize("codec", [f"pr:{CODEC}", f"qw:{CODEC}", "qw+pr:RQ3x8"])
def test_residual_or_weighted_codes_alone_answer_as_their_index_time_index(workdir, tmp_path,
                                                                           codec):
  """Passage residuals without the weighting (coded at each shard's end), the weighting without
  residuals (coded batch by batch) and both with residual quantization (RQ) codes: each dump's
  index is the index coded from the full dump's vectors, byte for byte."""
  threshold = _threshold(workdir)
  copy = tmp_path / "demo"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("codes", "kept", "residual"))
  assert _run(copy, "dump", "index.dump_name=mine", f"index.dump_codec={codec}",
              "index.dump_vectors=False", f"index.dump_filter_threshold={threshold!r}") == 0
  settings, opened, _, _ = open_workdir("experiments/demo.py:tiny", copy,
                                        ["index.dump_name=full"])
  full_dir = build_index(copy / "full", f"compact:{codec}", filter_threshold=threshold,
                         weighting=question_weighting(settings, opened))
  codes_dir = build_index(copy / "mine", "compact")
  parts = sorted(p.name for p in full_dir.iterdir() if p.suffix in (".npy", ".faiss"))
  assert ("weighting.npy" in parts) == codec.startswith("qw")
  assert ("passage_means.npy" in parts) == ("pr" in codec.split(":")[0])
  assert parts == sorted(p.name for p in codes_dir.iterdir() if p.suffix in (".npy", ".faiss"))
  for part in parts:
    assert (full_dir / part).read_bytes() == (codes_dir / part).read_bytes(), part


def test_a_residual_codecs_sample_holds_passages_enough_for_its_means(workdir, monkeypatch):
  """A passage-residual codec's sample reads on past `train_size` tokens until it holds the
  passages a PQ means codec needs (here 20 of the corpus's 30)."""
  monkeypatch.setattr(dump_codes.residual, "PQ_MEANS_MIN_PASSAGES", 20)
  assert dump_codes.sample_targets(_config(CODEC, 40)) == (40, 0)
  assert dump_codes.sample_targets(_config(RESIDUAL, 40)) == (40, 20)
  assert dump_codes.sample_targets(_config("qw:" + CODEC, 1 << 20)) == (1 << 17, 0)
  from dpjax.parallel import make_mesh
  tokenizer, corpus, model = _encoder(workdir)
  held = {}
  for codec in (CODEC, RESIDUAL):
    parts, record = dump_codes.codec_sample(corpus, tokenizer, _config(codec, 40),
                                            make_mesh(local=True), model)
    places = np.concatenate([places for places, _ in parts])
    assert len(places) >= 40
    held[codec] = (len(np.unique(places)), record["reads"])
  assert held[CODEC][0] < 20 <= held[RESIDUAL][0] and held[RESIDUAL][1] > 1


def _config(codec: str, train_size: int):
  from dpjax.index.manifest import DumpConfig
  return DumpConfig(max_seq_length=64, doc_stride=32, include_title=True, batch_size=8,
                    shard_passages=7, codec=codec, train_size=train_size)


def _encoder(workdir):
  """(the tiny workdir's tokenizer, corpus, phrase encoder as a dump calls it)."""
  from dpjax.data import Tokenizer
  from dpjax.data.corpus import read_corpus
  from dpjax.loading import data_paths, restore_model
  from dpjax.models.encoders import bound
  settings, opened, _, _ = open_workdir("experiments/demo.py:tiny", workdir,
                                       ["index.dump_name=full"])
  model, _ = restore_model(settings.model, settings.data, settings.eval, opened)
  corpus = list(read_corpus(data_paths(settings.data, settings.index, opened)["corpus"]))
  return (Tokenizer.from_pretrained(settings.model.tokenizer), corpus,
          bound(model, "phrases_and_filter"))


def test_dump_time_filtering_answers_as_index_time_filtering(workdir):
  q_start, q_end = _questions(workdir)
  want = _top(PhraseIndex(workdir / "full", index_folder("Flat", _threshold(workdir))),
              q_start, q_end)
  assert _top(PhraseIndex(workdir / "kept", "Flat"), q_start, q_end) == want


@pytest.mark.parametrize("name, codec", [("codes", CODEC), ("residual", RESIDUAL)])
def test_a_killed_codes_dump_resumes_by_shard_to_the_same_files(workdir, tmp_path, name, codec):
  """The last shard deleted and the manifest marked incomplete (a kill before the end): the
  rerun encodes that shard only, with the coding it trained before (a residual one's means
  codec and question weighting too: no question is encoded again)."""
  copy = tmp_path / "demo"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("full", "kept", "indexes"))
  manifest = read_manifest(copy / name)
  last = copy / name / manifest["shards"][-1]["name"]
  before = _files(last)
  coding = {path.name: path.stat().st_mtime_ns for path in (copy / name).glob("*.*")
            if path.suffix in (".faiss", ".npy")}
  assert len(coding) == (3 if name == "residual" else 1)
  shutil.rmtree(last)
  write_manifest(copy / name, {**manifest, "complete": False, "shards": []})
  assert _run(copy, "dump", f"index.dump_name={name}", f"index.dump_codec={codec}",
              "index.dump_vectors=False", "index.sparse_tune_file=/nonexistent.json",
              f"index.dump_filter_threshold={_threshold(workdir)!r}") == 0
  assert _files(last) == before
  assert coding == {path: (copy / name / path).stat().st_mtime_ns for path in coding}
  assert read_manifest(copy / name)["dump_id"] == manifest["dump_id"]


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
  with pytest.raises(DumpError, match="index.dump_vectors"):  # another residual codec
    build_index(workdir / "residual", "compact:qw+pr:PQ5")
  # the dump's own residual codes: assembled with its weighting, no question encoded
  built = build_index(workdir / "residual", f"compact:{RESIDUAL}", name="again",
                      weighting=lambda: pytest.fail("questions encoded"))
  assert (built / "weighting.npy").read_bytes() == (
      workdir / "residual" / "indexes" / "compact" / "weighting.npy").read_bytes()
  assert _run(workdir, "index", "index.dump_name=codes", 'index.specs=["Flat"]') == 2
  assert _run(workdir, "subcorpus", "index.dump_name=codes") == 2


@pytest.mark.parametrize("name, part", [("codes", "codec.faiss"), ("residual", "weighting.npy"),
                                        ("residual", "means_codec.faiss")])
def test_verify_checks_the_dumps_codec(workdir, tmp_path, name, part):
  copy = tmp_path / "demo"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("full", "kept"))
  assert _run(copy, "verify") == 0
  codec = copy / name / part
  data = bytearray(codec.read_bytes())
  data[-1] ^= 1
  codec.write_bytes(bytes(data))
  assert _run(copy, "verify") == 2


@pytest.mark.parametrize("sets", [("index.dump_vectors=False",),
                                  ("index.dump_codec=IVF4,PQ6",),
                                  ("index.dump_codec=PQ7", "index.dump_vectors=False"),
                                  ("index.dump_codec=qw:PQ7",),
                                  (f"index.dump_codec={RESIDUAL}",
                                   "index.sparse_tune_file=/nonexistent.json")])
def test_codec_settings_that_cannot_work_are_refused(workdir, tmp_path, sets):
  """No codec for a dump without vectors, a codec of no flat codes, one faiss cannot make for
  30-d vectors (7 sub-vectors, weighted or not), a question-weighted one without training
  questions: one line, exit 2, nothing written."""
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
