"""Bad input and bad state are named at the boundary: one test per defect of the hostile sweep
(results/reliability.md). Each case failed (silently wrong, a traceback or a hang) before."""
import concurrent.futures
import errno
import json
import logging
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
from flax import nnx

from conftest import REPO
from dpjax.config import load_config
from dpjax.data.corpus import read_corpus
from dpjax.data.squad import Passage, SkipSummary, read_squad
from dpjax.data.synthetic import write_synthetic
from dpjax.data.tokenization import Tokenizer
from dpjax.errors import ConfigError, DumpError
from dpjax.index import shards as shards_module
from dpjax.index.dump import dump_phrases
from dpjax.index.manifest import DumpConfig
from dpjax.index.shard_stream import ShardStream
from dpjax.index.faiss_index import build_index
from dpjax.index.phrase_index import PhraseIndex
from dpjax.io import workdir_lock
from dpjax.models import BertConfig, DensePhrases
from dpjax.parallel import make_mesh

import run

TINY = BertConfig(vocab_size=30522, hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=13, max_position_embeddings=64)
CONFIG = DumpConfig(max_seq_length=29, doc_stride=7, batch_size=8, shard_passages=3)
TRAIN = ["train", "--config", "experiments/demo.py:tiny", "--set", "train.checkpoint_every=3"]


def _passages(n=8, salt=""):
  words = "the quick brown fox jumps over a lazy dog near river banks at dawn".split()
  return [Passage(f"p{i}", f"Title {i % 3}", " ".join(words[: 3 + (7 * i) % 40] * 2) + salt)
          for i in range(n)]


@pytest.fixture(scope="module")
def model():
  return DensePhrases(TINY, rngs=nnx.Rngs(0))


def _cli(*args, timeout=300):
  """run.py in a subprocess: (exit code, stderr)."""
  result = subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
  return result.returncode, result.stderr


# --- dumps and indexes know their corpus -----------------------------------------------------


def test_complete_dump_refuses_another_corpus(model, tokenizer, tmp_path):
  dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  assert dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())[
      "complete"]  # the same corpus: reused
  with pytest.raises(DumpError, match="corpus changed"):
    dump_phrases(model, tokenizer, _passages(salt=" extra"), tmp_path, CONFIG, mesh=make_mesh())
  full = tmp_path / "three_full_shards"
  dump_phrases(model, tokenizer, _passages(9), full, CONFIG, mesh=make_mesh())
  with pytest.raises(DumpError, match="more passages"):
    dump_phrases(model, tokenizer, _passages(10), full, CONFIG, mesh=make_mesh())
  with pytest.raises(DumpError, match="fewer passages"):
    dump_phrases(model, tokenizer, _passages(6), full, CONFIG, mesh=make_mesh())


def test_resumed_dump_refuses_a_changed_corpus(model, tokenizer, tmp_path):
  dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  manifest = json.loads((tmp_path / "manifest.json").read_text())
  (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
  shutil.rmtree(tmp_path / "shard_00002")  # as if killed before the last shard
  changed = _passages()
  changed[1] = Passage("new", "Other", "another passage in place of p1")
  with pytest.raises(DumpError, match="shard_00000 holds other passages"):
    dump_phrases(model, tokenizer, changed, tmp_path, CONFIG, mesh=make_mesh())


def test_resumed_dump_refuses_another_tokenizer_or_filter_head(model, tokenizer, tmp_path):
  """A dump resumed with another tokenizer, or after `run.py filter` wrote a filter head, went
  on without a word (only the phrase encoder was compared): shards of two tokenizations or two
  heads' filter logits in one dump."""
  dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  manifest = json.loads((tmp_path / "manifest.json").read_text())
  assert manifest["tokenizer"] == tokenizer.fingerprint and manifest["filter_head"] is None
  (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
  shutil.rmtree(tmp_path / "shard_00002")  # as if killed before the last shard
  spec = json.loads(tokenizer.backend.to_str())
  spec["normalizer"]["lowercase"] = False
  cased = Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
  assert cased.fingerprint != tokenizer.fingerprint
  with pytest.raises(DumpError, match="made with another tokenizer"):
    dump_phrases(model, cased, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  with pytest.raises(DumpError, match=r"another token filter head \(filter_head.npz\)"):
    dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh(),
                 filter_head={"file": "filter_head.npz", "sha": "0123456789abcdef"})
  assert not (tmp_path / "shard_00002").exists()
  assert dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())[
      "complete"]  # with its own tokenizer and head it resumes


def test_index_and_eval_refuse_a_dump_of_another_corpus_or_windows(tmp_path):
  """`run.py dump` refused to add to a dump of another corpus or windows, but index, eval and
  search used it as it was: scores over the old corpus reported as the new one's. A filter head
  written after the dump is refused likewise when the dump is run again."""
  workdir = str(tmp_path / "w")
  base = ["--config", "experiments/demo.py:tiny", "--workdir", workdir]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0
  other = tmp_path / "other.jsonl"
  other.write_text(json.dumps({"id": "x", "title": "X", "text": "one passage only"}) + "\n")
  for mode, override, message in (
      ("index", f"index.corpus=['{other}']", re.escape("is a dump of another corpus (corpus.json;"
                                                       " index.corpus gives other.jsonl")),
      ("eval", "data.doc_stride=20", r"is a dump of other windows: doc_stride \d+ \(the "
                                     r"config's 20\)"),
      ("search", "index.dump_min_context=5", re.escape("min_context 0 (the config's 5)"))):
    code, stderr = _cli(mode, *base, "--set", override, *(["--query", "who?"] if mode == "search"
                                                          else []))
    assert code == 2 and re.search(message, stderr) and "Traceback" not in stderr, stderr
  assert run.main(["eval"] + base) == 0  # its own settings: fine
  np.savez(pathlib.Path(workdir) / "filter_head.npz", kernel=np.zeros((30, 2), np.float32),
           bias=np.zeros(2, np.float32))
  code, stderr = _cli("dump", *base)
  assert code == 2 and "another token filter head" in stderr, stderr


def test_index_of_another_dump_is_refused(model, tokenizer, tmp_path):
  first, second = tmp_path / "first", tmp_path / "second"
  dump_phrases(model, tokenizer, _passages(), first, CONFIG, mesh=make_mesh())
  build_index(first, "Flat")
  dump_phrases(model, tokenizer, _passages(salt=" x"), second, CONFIG, mesh=make_mesh())
  shutil.copytree(first / "indexes", second / "indexes")  # same model, other dump
  with pytest.raises(DumpError, match="built from another dump"):
    PhraseIndex(second, "Flat")
  PhraseIndex(first, "Flat")  # its own dump: fine


def test_dump_write_error_names_the_shard_and_cause(model, tokenizer, tmp_path, monkeypatch):
  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(shards_module.np, "save", full)
  with pytest.raises(DumpError, match=r"shard_00000: could not write the shard: No space left "
                                      r"on device \(errno 28\)"):
    dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  assert not list(tmp_path.glob("*.tmp"))


def test_a_later_shards_writes_report_the_dumps_first_failed_write(tmp_path, monkeypatch):
  """Shards written by one writer thread: when shard 0's write fails, the writes of shard 1
  queued behind it raise shard 0's error (whichever the dump's thread asks first), and neither
  leaves its temporary directory."""
  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(shards_module.np, "save", full)
  tables = {"token_passage": np.zeros(2, np.int32)}
  failed = []
  with concurrent.futures.ThreadPoolExecutor(1) as writer:
    first, second = (ShardStream(tmp_path, name, 4, writer, failed)
                     for name in ("shard_00000", "shard_00001"))
    for stream in (first, second):
      stream.tables(tables, _passages(2))
    concurrent.futures.wait(first.pending + second.pending)
    with pytest.raises(DumpError, match=r"shard_00000: could not write the shard: No space"):
      second.finish(2)
    second.close()
  assert [str(e) for e in failed] == [str(failed[0])] and "shard_00000" in str(failed[0])
  assert not list(tmp_path.iterdir())


def test_a_shard_sealed_by_the_sealer_reports_its_failure_and_leaves_nothing(
    model, tokenizer, tmp_path, monkeypatch):
  """A shard handed to the sealer thread (checksums, sync, rename) while the writer goes on:
  a sync that fails (the disk full) fails the dump with a DumpError naming that shard, every
  shard's temporary directory is removed, and a rerun once the disk has room resumes with the
  shards sealed before it and dumps what a dump that never failed dumps."""
  from dpjax.index import shard_stream
  commit = shard_stream.commit_directory
  calls = []

  def full_at_second(tmp, final):
    calls.append(final)
    if len(calls) == 2:
      raise OSError(errno.ENOSPC, "No space left on device")
    commit(tmp, final)
  monkeypatch.setattr(shard_stream, "commit_directory", full_at_second)
  with pytest.raises(DumpError, match=r"shard_00001: could not write the shard: No space left"):
    dump_phrases(model, tokenizer, _passages(), tmp_path / "dump", CONFIG, mesh=make_mesh())
  assert not list((tmp_path / "dump").glob("*.tmp"))
  assert (tmp_path / "dump" / "shard_00000").is_dir()  # sealed before: kept for the rerun
  assert not (tmp_path / "dump" / "shard_00001").exists()
  monkeypatch.setattr(shard_stream, "commit_directory", commit)
  resumed = dump_phrases(model, tokenizer, _passages(), tmp_path / "dump", CONFIG,
                         mesh=make_mesh())
  fresh = dump_phrases(model, tokenizer, _passages(), tmp_path / "fresh", CONFIG,
                       mesh=make_mesh())
  assert resumed["complete"] and resumed["num_tokens"] == fresh["num_tokens"]
  assert [s["files"] for s in resumed["shards"]] == [s["files"] for s in fresh["shards"]]


def test_failed_index_build_is_a_config_error_and_leaves_no_temporary(model, tokenizer,
                                                                      tmp_path):
  dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  with pytest.raises(ConfigError, match="index.specs: 'IVF4,Bogus' is not a faiss index"):
    build_index(tmp_path, "IVF4,Bogus")
  assert not list((tmp_path / "indexes").glob("*.tmp"))


def test_index_of_a_dump_without_tokens_says_so(model, tokenizer, tmp_path):
  """A corpus whose passages tokenize to nothing dumps 0 tokens; indexing it blamed "the filter
  threshold None", which no one had set."""
  passages = [Passage("a", "", "\u200b"), Passage("b", "", "\u200b\u200b")]
  manifest = dump_phrases(model, tokenizer, passages, tmp_path, CONFIG, mesh=make_mesh())
  assert (manifest["num_passages"], manifest["num_tokens"]) == (2, 0)
  with pytest.raises(DumpError, match=r"the dump holds no token \(2 passages"):
    build_index(tmp_path, "Flat")
  assert not list((tmp_path / "indexes").glob("*.tmp"))


# --- records the tokenizer or the evaluation cannot take ----------------------------------------


def test_lone_surrogate_record_is_skipped_and_counted(model, tokenizer, tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text('{"id": "a", "title": "A", "text": "fine text here"}\n'
                    '{"id": "b", "title": "B", "text": "broken \\ud800 text"}\n'
                    '{"id": "c", "title": "C", "text": "more fine text"}\n')
  summary = SkipSummary()
  passages = list(read_corpus(corpus, summary))
  assert [p.id for p in passages] == ["a", "c"]
  assert summary.counts == {"invalid Unicode (a lone surrogate) in id, title or text": 1}
  manifest = dump_phrases(model, tokenizer, passages, tmp_path / "dump", CONFIG,
                          mesh=make_mesh())
  assert manifest["num_passages"] == 2


def test_duplicate_question_ids_are_skipped_and_counted(tmp_path):
  qa = lambda qid: {"id": qid, "question": "Who?", "answers": [{"text": "Ann",
                                                                 "answer_start": 0}]}
  path = tmp_path / "dup.json"
  path.write_text(json.dumps({"data": [{"title": "T", "paragraphs": [
      {"context": "Ann met Bob.", "qas": [qa("q1"), qa("q2"), qa("q1")]}]}]}))
  _, questions, summary = read_squad(path)
  assert [q.id for q in questions] == ["q1", "q2"]
  assert summary.counts == {"duplicate question id (the first one is kept)": 1}


def test_search_arguments_are_checked(model, tokenizer, tmp_path):
  dump_phrases(model, tokenizer, _passages(), tmp_path, CONFIG, mesh=make_mesh())
  build_index(tmp_path, "Flat")
  index = PhraseIndex(tmp_path, "Flat")
  q = np.ones((2, TINY.hidden_size), np.float32)
  for k in (0, -3):
    with pytest.raises(ValueError, match="must be >= 1"):
      index.search(q, q, k)
    with pytest.raises(ValueError, match="must be >= 1"):
      index.search_phrases(q, q, k)
  with pytest.raises(ValueError, match="nprobe must be >= 1"):
    PhraseIndex(tmp_path, "Flat", nprobe=-1)


# --- configs and the command line -----------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["index.top_k=0"], "index.top_k = 0: must be a number >= 1"),
    (["index.nprobe=-2"], "index.nprobe = -2: must be a number >= 1"),
    (["train.batch_size=0"], "train.batch_size = 0: must be a number >= 1"),
    (["index.train_size=0"], "index.train_size = 0: must be a number >= 1"),
    (["data.max_query_length=1"], "data.max_query_length = 1: must be a number >= 2"),
    # tracebacks after work, or negative "first N" limits read as Python's slices from the end
    (["train.seed=-1"], "train.seed = -1: must be a number >= 0"),
    (['train.freeze=["("]'], "train.freeze: '(' is not a regular expression"),
    (["train.hard_negatives.per_example=0"], "per_example = 0: must be a number >= 1"),
    (["eval.passage_k=-5"], "eval.passage_k = -5: must be a number >= 0"),
    (["validation.limit=-11"], "validation.limit = -11: must be a number >= 0"),
    (["index.reread=-1"], "index.reread = -1: must be a number >= 0"),
    (["index.reread=2", "index.reread_margin=-0.5"],
     "index.reread_margin = -0.5: must be a number >= 0"),
    (["index.reread_margin=2.0"], "index.reread_margin is set without index.reread"),
    (["index.reread=2", "index.reread_window=0"], "index.reread_window = 0: must be a number >= 1"),
    (["index.reread_window=64"], "index.reread_window is set without index.reread"),
    (["index.reread_checkpoint=latest"], "index.reread_checkpoint is set without index.reread"),
    (["index.reread=2", "index.reread_checkpoint=newest"],
     "index.reread_checkpoint = 'newest': must be one of latest, best, qsft"),
    (["filter.dev_windows=0"], "filter.dev_windows = 0: must be a number >= 1"),
    (["filter.keep_fractions=[]"], "must be one or more fractions in (0, 1]"),
    (["filter.keep_fractions=[-0.5]"], "must be one or more fractions in (0, 1]"),
    (["filter.max_em_drop=-5"], "filter.max_em_drop = -5.0: must be a number >= 0"),
    (["train.nope=1"], "--set train.nope: no such config field"),
    (["train.batch_size=many"], "--set train.batch_size=many: wrong type"),
    (["train.batch_size"], "is not of the form key=value"),
    (["index.unit=word"], "index.unit = 'word': must be one of"),
    (["index.sparse_sentence_weight=0.5"], "index.sparse_sentence_weight is set without "
                                           "index.sparse_weight"),
])
def test_bad_config_values_are_named(overrides, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    load_config("experiments/demo.py:tiny", overrides)


def test_the_tokenizer_follows_model_name_unless_set():
  """`--set model.name=X` took X's weights but kept the default tokenizer (another vocabulary
  tokenized wrongly, without a word); model.tokenizer set as well wins."""
  assert load_config("experiments/demo.py", ["model.name=/m/x"]).model.tokenizer == "/m/x"
  both = load_config("experiments/demo.py", ["model.name=/m/x", "model.tokenizer=/m/t"])
  assert (both.model.name, both.model.tokenizer) == ("/m/x", "/m/t")
  assert load_config("experiments/demo.py").model.tokenizer == "minilm-l6"


def test_cli_errors_are_one_line_without_traceback(tmp_path):
  cases = [
      (["--config", "experiments/nope.py"], "config file not found: experiments/nope.py"),
      (["--config", "experiments/demo.py:huge"], "unknown config arg 'huge'"),
      (["--config", "experiments/demo.py:tiny", "--set", "index.top_k=0"], "index.top_k = 0"),
      (["--config", "experiments/demo.py", "--set", "model.name=/no/such/model"], "/no/such"),
  ]
  for args, message in cases:
    code, stderr = _cli("eval_rc", *args, "--workdir", str(tmp_path))
    assert code == 2 and message in stderr and "Traceback" not in stderr, (args, stderr)


def test_a_workdir_that_is_a_file_is_named(tmp_path, caplog):
  """A --workdir that is (or lies under) a file stopped with a bare "[Errno 17] File exists"."""
  path = tmp_path / "a_file"
  path.write_text("not a directory")
  for workdir, message in ((path, "is a file, not a directory"),
                           (path / "sub", f"lies under {path}, which is a file")):
    caplog.clear()
    assert run.main(TRAIN + ["--workdir", str(workdir)]) == 2
    assert f"--workdir {workdir} {message}" in caplog.text, caplog.text
    assert "Errno" not in caplog.text


def test_batch_not_a_multiple_of_the_devices_is_refused(tmp_path, caplog):
  """train.batch_size 6 on the 8 forced CPU devices (conftest) stops before any work with the
  field and the device count, and saves nothing."""
  import jax
  assert jax.device_count() == 8
  assert run.main(TRAIN + ["--workdir", str(tmp_path), "--set", "train.batch_size=6"]) == 2
  assert "train.batch_size 6 must be a multiple of the 8 devices" in caplog.text
  assert not (tmp_path / "checkpoints").exists()


def test_untrained_model_is_refused_unless_asked(tmp_path):
  base = ["dump", "--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(base) == 2  # a mistyped --workdir does not dump untrained weights
  assert not (tmp_path / "dump").exists()
  assert run.main(base + ["--set", "eval.allow_untrained=True"]) == 0


def test_a_checkpoint_of_another_model_is_refused(tmp_path, caplog):
  """Restoring parameters checks names and shapes: a model with a layer more kept that layer's
  random values, one with a layer less dropped a trained one, and another vocabulary took the
  checkpoint's embedding shape, all without a word."""
  workdir = str(tmp_path)
  assert run.main(TRAIN + ["--workdir", workdir, "--set", "train.stop_at_step=3"]) == 0
  dump = ["dump", "--config", "experiments/demo.py:tiny", "--workdir", workdir]
  for override, message in (("num_hidden_layers=3", "layers/2/.* missing"),
                            ("num_hidden_layers=1", "layers/1/.* not in the model"),
                            ("vocab_size=30000", r"\(30522, 30\) \(the model's \(30000, 30\)\)")):
    caplog.clear()
    assert run.main(dump + ["--set", f"model.random.{override}"]) == 2, override
    assert "a checkpoint of another model" in caplog.text, override
    assert re.search(message, caplog.text), (override, caplog.text)
  assert not (tmp_path / "dump").exists()
  # An Orbax whose metadata cannot be read here: the shapes restored are still checked.
  import orbax.checkpoint as ocp

  def unreadable(self, *args, **kwargs):
    raise ValueError("no metadata")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ocp.PyTreeCheckpointHandler, "metadata", unreadable)
    caplog.clear()
    assert run.main(dump + ["--set", "model.random.vocab_size=30000"]) == 2
    assert "not checked before restoring" in caplog.text
    assert "a checkpoint of another model" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert run.main(dump) == 0  # the model it was trained as
  # ... restored without a warning (Orbax's "Metadata file does not exist" came with every one)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_the_best_checkpoint_is_the_best_kept_not_the_newest(tmp_path):
  """checkpoints_best / _qsft keep one step, the best: a worse step is saved, then deleted, and
  a run killed in between leaves both. eval.checkpoint=best took the newest of them."""
  import jax
  from dpjax.checkpoint import Checkpointer
  from dpjax.models.densephrases import model_for_data
  from dpjax.loading import restore_model
  from dpjax.settings import Settings
  s = Settings.of(load_config("experiments/demo.py:tiny", ["eval.checkpoint='best'"]))
  params = nnx.to_pure_dict(nnx.state(model_for_data(s.model, s.data), nnx.Param))
  zeros = jax.tree.map(np.zeros_like, params)
  checkpointer = Checkpointer(tmp_path / "checkpoints_best", keep=1, best_metric="em@1")
  checkpointer.save(1, {"params": jax.tree.map(lambda x: {"value": x}, params)}, {"step": 1},
                    metrics={"em@1": 50.0})
  checkpointer.manager._checkpoint_deleter.delete_steps = lambda steps: None  # killed here
  checkpointer.save(2, {"params": jax.tree.map(lambda x: {"value": x}, zeros)}, {"step": 2},
                    metrics={"em@1": 10.0})
  checkpointer.close()
  assert sorted(p.name for p in (tmp_path / "checkpoints_best").iterdir() if p.name.isdigit()) \
      == ["1", "2"]
  model, step = restore_model(s.model, s.data, s.eval, tmp_path,
                              best_metric=s.validation.metric)
  assert step == 1
  restored = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, restored, params)


def test_damaged_files_are_named_not_tracebacks(tmp_path, caplog):
  """A damaged dump manifest, index manifest, faiss index or filter head (a disk fault, a copy
  cut short) stops the command with one line naming the file and what to do."""
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  assert run.main(TRAIN + ["--workdir", str(tmp_path), "--set", "train.stop_at_step=3"]) == 0
  assert run.main(["dump"] + base) == 0 and run.main(["index"] + base) == 0
  index = tmp_path / "dump" / "indexes" / "Flat"
  cases = [(tmp_path / "dump" / "manifest.json", "dump", "unreadable",
            "delete the dump's directory"),
           (index / "index_manifest.json", "eval", "unreadable", "build the index again"),
           # (its size, recorded when it was written, is checked before faiss reads it)
           (index / "index.faiss", "eval", "20 bytes", "build it again"),
           (tmp_path / "filter_head.npz", "dump", "unreadable", "run `run.py filter` again")]
  for path, mode, what, hint in cases:
    kept = path.read_bytes() if path.exists() else None
    path.write_bytes((kept or b"PK\x03\x04 not a zip")[:20])  # cut short
    caplog.clear()
    assert run.main([mode] + base) == 2, path
    assert f"{path}: {what}" in caplog.text and hint in caplog.text, caplog.text
    if kept is None:
      path.unlink()
    else:
      path.write_bytes(kept)
  assert run.main(["eval"] + base) == 0


def test_coordinator_wait_times_out_with_its_address(tmp_path):
  with socket.socket() as s:  # bound, never listening: connections are refused, and no other
    s.bind(("127.0.0.1", 0))  # process (another test's coordinator) can take the port meanwhile
    port = s.getsockname()[1]
    code, stderr = _cli("data", "--config", "experiments/demo.py:tiny", "--workdir",
                        str(tmp_path), "--coordinator", f"127.0.0.1:{port}", "--num_processes",
                        "2", "--process_id", "1", "--init_timeout", "3", timeout=120)
  assert code == 2 and f"could not join the job of coordinator 127.0.0.1:{port}" in stderr
  assert "Traceback" not in stderr


# --- training ------------------------------------------------------------------------------


def test_a_second_training_in_the_same_workdir_is_refused(tmp_path):
  import os
  tmp_path.mkdir(exist_ok=True)
  with workdir_lock(tmp_path / "train.lock"):  # a live run holds the workdir
    assert run.main(TRAIN + ["--workdir", str(tmp_path)]) == 2
    assert not (tmp_path / "checkpoints").exists()
  (tmp_path / "train.lock").write_text(str(os.getppid()))  # a live process's lock
  assert run.main(TRAIN + ["--workdir", str(tmp_path)]) == 2


def test_a_dead_runs_lock_is_taken_over_by_one_run_only(tmp_path, monkeypatch):
  """Two runs that find a dead run's lock at once: one takes it over, the other is refused (the
  read, unlink and link were separate steps: both unlinked and linked, and both ran). A lock of
  another host is never taken over: its process cannot be checked from here."""
  import subprocess
  import sys
  import threading
  import time

  from dpjax import io
  from dpjax.errors import BusyError
  lock = tmp_path / "train.lock"
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  lock.write_text(gone)
  read = io._lock_holder

  def slow_read(path):  # both runs read the dead run's pid before either takes the lock
    holder = read(path)
    time.sleep(0.3)
    return holder

  monkeypatch.setattr(io, "_lock_holder", slow_read)
  outcomes = []

  def run_one():
    try:
      with workdir_lock(lock):
        outcomes.append("ran")
        deadline = time.monotonic() + 60  # holds the lock until the other run has an outcome
        while len(outcomes) < 2 and time.monotonic() < deadline:
          time.sleep(0.01)
    except BusyError:
      outcomes.append("refused")

  threads = [threading.Thread(target=run_one) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(outcomes) == ["ran", "refused"] and not lock.exists()
  lock.write_text("123 some-other-host")
  with pytest.raises(BusyError, match="pid 123 on host some-other-host.*delete"):
    with workdir_lock(lock):
      pass
  lock.unlink()
  # A file system without flocks (some network ones): the lock still works, with a warning.
  import fcntl
  import os

  def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", no_flock)
  monkeypatch.setattr(io, "_lock_holder", read)
  with workdir_lock(lock):
    assert lock.read_text().split()[0] == str(os.getpid())
  assert not lock.exists()


def test_torn_last_metrics_line_does_not_block_resume(tmp_path):
  assert run.main(TRAIN + ["--workdir", str(tmp_path), "--set", "train.stop_at_step=3"]) == 0
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 4, "split": "tra')  # killed while writing
  assert run.main(TRAIN + ["--workdir", str(tmp_path)]) == 0
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_divergence_stops_before_a_checkpoint(tmp_path):
  assert run.main(TRAIN + ["--workdir", str(tmp_path), "--set", "train.learning_rate=1e6",
                           "--set", "train.warmup_steps=1", "--set",
                           "train.freeze=[]"]) == 2
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  last_good = max([r["step"] for r in records if r["split"] == "train"], default=0)
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").glob("[0-9]*"))
  assert all(step <= last_good for step in saved)  # no checkpoint of a diverged state
  assert last_good < 6


def test_resume_refuses_other_training_data(tmp_path):
  def squad_dir(seed):
    folder = tmp_path / f"data{seed}"
    files = write_synthetic(folder, seed=seed, num_train_entities=6, num_dev_entities=4,
                            questions_per_entity=3)
    files["train"].rename(folder / "train-v1.1.json")
    files["dev"].rename(folder / "dev-v1.1.json")
    return folder
  base = ["train", "--config", "experiments/squad.py:tiny", "--workdir", str(tmp_path / "w"),
          "--set", "train.checkpoint_every=3", "--set", "eval.limit=4"]
  first, other = squad_dir(0), squad_dir(1)
  assert run.main(base + ["--set", f"data.dir={first}", "--set", "train.stop_at_step=3"]) == 0
  # Another folder with the same data resumes (data.dir may move)...
  shutil.copytree(first, tmp_path / "moved")
  assert run.main(base + ["--set", f"data.dir={tmp_path / 'moved'}",
                          "--set", "train.stop_at_step=4"]) == 0
  # ...other data under the same name does not.
  shutil.copy(other / "train-v1.1.json", tmp_path / "moved" / "train-v1.1.json")
  assert run.main(base + ["--set", f"data.dir={tmp_path / 'moved'}"]) == 2


def test_synthetic_data_is_not_rewritten(tmp_path):
  first = write_synthetic(tmp_path, seed=0, num_train_entities=6, num_dev_entities=4,
                          questions_per_entity=3)
  stamps = {k: p.stat().st_mtime_ns for k, p in first.items()}
  again = write_synthetic(tmp_path, seed=0, num_train_entities=6, num_dev_entities=4,
                          questions_per_entity=3)
  assert {k: p.stat().st_mtime_ns for k, p in again.items()} == stamps
