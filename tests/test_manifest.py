"""One definition each: a dump's manifest read (older fields normalised once) and checked before
any shard is read, an index checked against its dump, a workdir's layout, the config's defaults."""
import json
import pathlib
import re

import ml_collections
import pytest

from dpjax.config import eval_config, index_config, with_defaults, workdir_config
from dpjax.errors import DataError, DumpError
from dpjax.index.manifest import (FORMAT, LEGACY_SETTINGS, MANIFEST, check_dump, check_index_of_dump,
                                  existing_manifest, read_manifest, write_manifest)
from dpjax.workdir import Workdir

WINDOWS = {"max_seq_length": 29, "doc_stride": 7, "include_title": True, "min_context": 0}


def _old_dump(directory: pathlib.Path) -> dict:
  """The manifest of a complete dump from before min_context and compute_dtype were recorded,
  its shards absent (nothing may read them)."""
  directory.mkdir(parents=True)
  manifest = {"complete": True, "fingerprint": "f", "num_tokens": 5, "num_passages": 1,
              "settings": {k: v for k, v in WINDOWS.items() if k != "min_context"},
              "shards": [{"name": "shard_00000", "passages": 1, "tokens": 5}]}
  (directory / MANIFEST).write_text(json.dumps(manifest))  # format 1: no "format"
  return manifest


def test_an_older_manifest_is_normalised_once_on_reading(tmp_path):
  _old_dump(tmp_path / "dump")
  settings = read_manifest(tmp_path / "dump")["settings"]
  assert {k: settings[k] for k in LEGACY_SETTINGS} == LEGACY_SETTINGS
  # Written again, it is of the current format, every setting recorded; one of that format is
  # taken as written (a setting missing from it is refused by the checks, not filled in).
  write_manifest(tmp_path / "dump", read_manifest(tmp_path / "dump"))
  written = json.loads((tmp_path / "dump" / MANIFEST).read_text())
  assert written["format"] == FORMAT and written["settings"] == settings
  del written["settings"]["compute_dtype"]
  (tmp_path / "dump" / MANIFEST).write_text(json.dumps(written))
  assert "compute_dtype" not in read_manifest(tmp_path / "dump")["settings"]
  _old_dump(tmp_path / "again")
  new = {"fingerprint": "f", "settings": {**WINDOWS, "compute_dtype": "float32"},
         "tokenizer": "t", "filter_head": None}
  assert existing_manifest(tmp_path / "again", new)["complete"]  # the same settings, resumable
  with pytest.raises(DumpError, match=r"other settings: compute_dtype 'float32' \(now "):
    existing_manifest(tmp_path / "again", {**new, "settings": {**new["settings"],
                                                              "compute_dtype": "bfloat16"}})


def test_the_dump_is_checked_on_its_manifest_before_any_shard_is_read(tmp_path):
  dump = tmp_path / "dump"
  manifest = _old_dump(dump)
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("{}\n")
  no_corpus = lambda: pytest.fail("the corpus is listed only when the manifest records one")
  check_dump(read_manifest(dump), dump, windows=WINDOWS, corpus=no_corpus, fingerprint="f")
  with pytest.raises(DataError, match=re.escape("doc_stride 7 (the config's 8)")):
    check_dump(read_manifest(dump), dump, windows={**WINDOWS, "doc_stride": 8}, corpus=no_corpus)
  with pytest.raises(DataError, match="dumped by another model"):
    check_dump(read_manifest(dump), dump, windows=WINDOWS, corpus=no_corpus, fingerprint="g")
  manifest["corpus"] = {"files": [{"path": "/elsewhere/corpus.jsonl", "bytes": 1}]}
  write_manifest(dump, manifest)
  with pytest.raises(DataError, match="a dump of another corpus"):
    check_dump(read_manifest(dump), dump, windows=WINDOWS, corpus=lambda: [corpus])


def test_an_index_is_checked_against_its_dump(tmp_path):
  dump = {"fingerprint": "f", "num_tokens": 5, "dump_id": "d", "filter_head": None}
  index = {"fingerprint": "f", "dump_tokens": 5, "dump_id": "d", "labels": "token_id",
           "filter_threshold": None}
  check_index_of_dump(tmp_path / "i", index, tmp_path, dump)
  for changed, message in (({"dump_id": "e"}, "built from another dump"),
                           ({"labels": None}, "older dpjax"),
                           ({"filter_threshold": 0.5, "filter_head": {"sha": "h"}},
                            "another filter head")):
    with pytest.raises(DumpError, match=message):
      check_index_of_dump(tmp_path / "i", {**index, **changed}, tmp_path, dump)


def test_the_workdir_layout():
  workdir = Workdir("/w")
  config = ml_collections.ConfigDict({"index": {"dump_name": "d"}})
  name = config.index.dump_name
  assert [str(p) for p in (workdir.checkpoints(), workdir.checkpoints("best"),
                           workdir.checkpoints("qsft"), workdir.dump(name), workdir.indexes(name),
                           workdir.filter_head, workdir.metrics, workdir.results,
                           workdir.teacher.checkpoints())] == [
      "/w/checkpoints", "/w/checkpoints_best", "/w/checkpoints_qsft", "/w/d", "/w/d/indexes",
      "/w/filter_head.npz", "/w/metrics.jsonl", "/w/results.json", "/w/teacher/checkpoints"]
  assert Workdir(workdir) == workdir and (workdir / MANIFEST).name == MANIFEST


def test_a_saved_config_without_newer_fields_gets_their_defaults(tmp_path):
  old_eval = {k: v for k, v in eval_config().to_dict().items() if k != "throughput_questions"}
  old_index = {k: v for k, v in index_config().to_dict().items()
               if k not in ("search_device", "verify")}
  (tmp_path / "dpjax_config.json").write_text(json.dumps(
      {"config": "experiments/demo.py:tiny", "set": [],
       "resolved": {"eval": old_eval, "index": old_index}}))
  config = workdir_config(None, ["index.verify=False"], str(tmp_path))
  assert config.eval.throughput_questions == eval_config().throughput_questions
  assert config.index.search_device == "auto" and config.index.verify is False
  assert with_defaults(ml_collections.ConfigDict()) == ml_collections.ConfigDict()
