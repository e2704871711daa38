"""One writer per workdir, and every artifact a later run reads checked against the digest
recorded when it was written (issue 61, items 2 and 3). Each case passed silently before: two
dumps in one workdir removed each other's shards, and a zeroed block in a shard, an index or a
checkpoint was searched or restored without a word."""
import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO
import dpjax.io
from dpjax.errors import DataError, DumpError
from dpjax.index import shards as shards_module
from dpjax.index.dump import dump_phrases
from dpjax.index.manifest import DumpConfig
from dpjax.parallel import make_mesh
from dpjax.workdir import FILTER_HEAD
from dpjax.loading import read_filter_head, save_filter_head

import run

TINY = ["--config", "experiments/demo.py:tiny"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
  """A tiny workdir, trained (steps 3 and 6 kept), dumped and indexed; tests use copies."""
  workdir = tmp_path_factory.mktemp("trained")
  base = TINY + ["--workdir", str(workdir)]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0
  return workdir


def _copy(trained: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
  workdir = tmp_path / "w"
  shutil.copytree(trained, workdir)
  return workdir, TINY + ["--workdir", str(workdir)]


def _zero_block(path: pathlib.Path) -> None:
  """Zeroes 4 KiB (or a quarter) in the middle of a file: its size stays the same."""
  size = path.stat().st_size
  with path.open("r+b") as f:
    f.seek(size // 2)
    f.write(bytes(min(4096, size // 4)))


def _largest_array_file(workdir: pathlib.Path) -> pathlib.Path:
  """The biggest array data file of the latest checkpoint step (what eval restores)."""
  step = max((p for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()),
             key=lambda p: int(p.name))
  return max((p for p in (step / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)


# --- one writer at a time -----------------------------------------------------------------------


# run.py whose dump and index build first wait a few seconds (inside the workdir's lock): a tiny
# index is built in less time than two processes' start-ups may differ by.
SLOW_RUN = """import sys, time
import dpjax.main.dump, dpjax.main.index
def slow(fn):
  return lambda *args, **kwargs: (time.sleep(4), fn(*args, **kwargs))[1]
dpjax.main.dump.dump_phrases = slow(dpjax.main.dump.dump_phrases)
dpjax.main.index.build_index = slow(dpjax.main.index.build_index)
import run
sys.argv[0] = "run.py"
sys.exit(run.main())
"""


def _together(mode: str, base: list[str]) -> list[tuple[int, int, str]]:
  """Two `run.py MODE` processes started together: (pid, exit code, stderr) of each, in the
  order they exited; the first to exit is checked to have done so while the other still ran."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  runs = [subprocess.Popen([sys.executable, "-c", SLOW_RUN, mode] + base, cwd=REPO, env=env,
                           stderr=subprocess.PIPE, text=True) for _ in range(2)]
  deadline = time.monotonic() + 300
  while all(r.poll() is None for r in runs) and time.monotonic() < deadline:
    time.sleep(0.05)
  first = next(r for r in runs if r.poll() is not None)
  other = next(r for r in runs if r is not first)
  still_running = other.poll() is None
  done = []
  for r in (first, other):
    _, stderr = r.communicate(timeout=300)
    done.append((r.pid, r.returncode, stderr))
  assert still_running, "the first to exit should be refused before the other finished"
  return done


@pytest.mark.slow
def test_two_dumps_or_index_builds_at_once_one_runs_one_is_refused(trained, tmp_path):
  """Two dumps started a second apart in one workdir: one exited 0, the other told the user to
  "free space" (a file the first removed), and `run.py index` then found a shard gone."""
  workdir, base = _copy(trained, tmp_path)
  shutil.rmtree(workdir / "dump")
  lock = workdir / "workdir.lock"
  for mode in ("dump", "index"):
    (refused_pid, refused, message), (pid, code, _) = _together(mode, base)
    assert (refused, code) == (2, 0), message
    line = next(l for l in message.splitlines() if "ERROR" in l)
    assert f"{lock}: another run (pid {pid}: run.py {mode} --config" in line, message
    assert "Traceback" not in message and refused_pid != pid
    assert not lock.exists()
  assert run.main(["verify"] + base) == 0
  assert run.main(["eval"] + base) == 0


def test_a_live_writers_lock_refuses_and_a_dead_ones_is_taken_over(trained, tmp_path, caplog):
  workdir, base = _copy(trained, tmp_path)
  lock = workdir / "workdir.lock"
  lock.write_text(f"{os.getppid()} {os.uname().nodename} run.py filter --config x")
  assert run.main(["index"] + base) == 2
  assert f"another run (pid {os.getppid()}: run.py filter --config x)" in caplog.text
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  lock.write_text(f"{gone} {os.uname().nodename} run.py dump --config x")
  caplog.clear()
  assert run.main(["index"] + base) == 0
  assert f"taking over the lock of a run that is gone (pid {gone}: run.py dump" in caplog.text
  assert not lock.exists()


def test_a_write_error_names_its_cause_not_a_guess(tmp_path, monkeypatch, tokenizer):
  """A missing file (another run removed the shard's folder) was reported as "free space"."""
  from flax import nnx

  from dpjax.data.squad import Passage
  from dpjax.models import BertConfig, DensePhrases
  model = DensePhrases(BertConfig(vocab_size=30522, hidden_size=12, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=13,
                                  max_position_embeddings=64), rngs=nnx.Rngs(0))

  def gone(path, *args, **kwargs):
    raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

  monkeypatch.setattr(shards_module.np, "save", gone)
  with pytest.raises(DumpError, match=r"shard_00000: could not write the shard: No such file "
                                      r"or directory \(errno 2\)") as error:
    dump_phrases(model, tokenizer, [Passage("p", "T", "a few words of text")], tmp_path,
                 DumpConfig(max_seq_length=29, doc_stride=7, batch_size=8), mesh=make_mesh())
  assert "free space" not in str(error.value)


# --- integrity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target, rerun", [
    (lambda w: w / "dump" / "shard_00000" / "vectors.npy", "then run `run.py dump`"),
    (lambda w: w / "dump" / "indexes" / "Flat" / "index.faiss", "build the index again"),
    (_largest_array_file, "an earlier checkpoint is then used"),
])
def test_verify_finds_a_zeroed_block_and_eval_refuses_it(trained, tmp_path, caplog, target,
                                                         rerun):
  workdir, base = _copy(trained, tmp_path)
  assert run.main(["verify"] + base) == 0
  path = target(workdir)
  _zero_block(path)
  caplog.clear()
  assert run.main(["verify"] + base) == 2
  damaged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
  assert any(m.startswith(f"{path}: its bytes differ") and rerun in m for m in damaged), damaged
  caplog.clear()
  assert run.main(["eval"] + base) == 2
  errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
  assert len(errors) == 1 and errors[0].startswith(f"{path}: its bytes differ"), errors
  assert "\n" not in errors[0]
  # index.verify=False skips the contents (very large indexes; Orbax's reads may still notice a
  # checkpoint's damage); sizes are still checked.
  if "checkpoints" not in path.parts:
    assert run.main(["eval"] + base + ["--set", "index.verify=False"]) == 0
  with path.open("ab") as f:
    f.write(b"\0")
  caplog.clear()
  assert run.main(["eval"] + base + ["--set", "index.verify=False"]) == 2
  assert f"{path}: {path.stat().st_size} bytes, {path.stat().st_size - 1} when" in caplog.text


def test_verify_and_hybrid_eval_refuse_a_damaged_bm25_index(trained, tmp_path, caplog):
  workdir, base = _copy(trained, tmp_path)
  hybrid = base + ["--set", "index.sparse=True", "--set", "index.sparse_weight=1.0"]
  assert run.main(["index"] + hybrid + ["--set", "index.specs=[]"]) == 0
  assert run.main(["verify"] + base) == 0
  path = workdir / "dump" / "indexes" / "bm25" / "data.csc.index.npy"
  _zero_block(path)
  caplog.clear()
  assert run.main(["verify"] + base) == 2
  damaged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
  assert any(m.startswith(f"{path}: its bytes differ") and "index.sparse=True" in m
             for m in damaged), damaged
  caplog.clear()
  assert run.main(["eval"] + hybrid) == 2
  errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
  assert len(errors) == 1 and errors[0].startswith(f"{path}: its bytes differ"), errors
  assert run.main(["eval"] + base) == 0  # the dense search does not read it


@pytest.mark.slow
def test_serve_refuses_a_zeroed_shard_or_index(trained, tmp_path):
  """`run.py serve` checks the contents at start as eval does: exit 2, one line naming the file
  (a subprocess with a time limit: a server that started would not return)."""
  for name in ("dump/shard_00000/vectors.npy", "dump/indexes/Flat/index.faiss"):
    workdir, base = _copy(trained, tmp_path / name.replace("/", "_"))
    path = workdir / name
    _zero_block(path)
    result = subprocess.run([sys.executable, "run.py", "serve", *base, "--set", "serve.port=0"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"{path}: its bytes differ from when it was written" in errors[0]


def test_artifacts_without_digests_load_and_verify_accepts_them_when_asked(trained, tmp_path,
                                                                          caplog):
  """Dumps, indexes and checkpoints written before digests were recorded still load; `verify`
  names each as unverified and exits 2 (it exited 0: nothing of them had been checked) unless
  `--allow_unverified` accepts them."""
  workdir, base = _copy(trained, tmp_path)
  for path in [workdir / "dump" / "manifest.json", *workdir.glob("dump/shard_*/shard.json")]:
    manifest = json.loads(path.read_text())
    for shard in manifest.get("shards", [manifest]):
      del shard["files"]
    path.write_text(json.dumps(manifest))
  index = workdir / "dump" / "indexes" / "Flat" / "index_manifest.json"
  index.write_text(json.dumps({k: v for k, v in json.loads(index.read_text()).items()
                               if k != "files"}))
  for record in workdir.glob("checkpoints/*/dpjax_checksums.json"):
    record.unlink()
  caplog.clear()
  assert run.main(["verify"] + base) == 2
  assert caplog.text.count("unverified (written before digests were recorded)") == 4
  assert "4 artifacts without digests to check them by" in caplog.records[-1].getMessage()
  caplog.clear()
  assert run.main(["verify"] + base + ["--allow_unverified"]) == 0
  assert caplog.text.count("unverified (written before digests were recorded)") == 4
  assert run.main(["eval"] + base) == 0


def _remove(path: pathlib.Path) -> None:
  shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.parametrize("target, refused", [
    (lambda w: w / "dump" / "manifest.json", "a dump's shards without its manifest"),
    (lambda w: w / "checkpoints" / "6" / "state", "a checkpoint step without its saved arrays"),
    (lambda w: w / "dump" / "indexes" / "Flat" / "index_manifest.json",
     "an index folder without its manifest"),
])
def test_verify_refuses_what_it_cannot_check(trained, tmp_path, caplog, target, refused):
  """A dump without its manifest (its shards went unchecked), a checkpoint step without its
  state (a restore passes over it for an earlier one) and an index folder without its manifest
  were passed over without a word, and verify exited 0."""
  workdir, base = _copy(trained, tmp_path)
  path = target(workdir)
  _remove(path)
  for allow in ([], ["--allow_unverified"]):  # missing is damage, not an older format
    caplog.clear()
    assert run.main(["verify"] + base + allow) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(m.startswith(f"{path}: missing ({refused}") for m in errors), errors
    assert "Traceback" not in caplog.text


def test_verify_checks_teacher_logits(trained, tmp_path, caplog):
  """Teacher logits (shards without a dump's records) were taken for a dump and verify stopped
  with a TypeError. Complete ones record their shards' digests: verified, and a same-size
  change is damage (and a load refuses a resized shard); ones written before the digests were
  recorded are unverified."""
  from dpjax.data.teacher_logits import TeacherLogits, write_teacher_logits
  workdir, base = _copy(trained, tmp_path)
  logits = workdir / "teacher" / "logits"
  compute = lambda rows: np.tile(rows[:, None, None], (1, 2, 5)).astype(np.float16)
  write_teacher_logits(logits, {"data": "d", "length": 5}, np.arange(7), compute, shard_rows=4)
  assert run.main(["verify"] + base) == 0
  shard = logits / "shard_00001" / "logits.npy"
  data = bytearray(shard.read_bytes())
  data[-1] ^= 0xFF  # same size, other bytes
  shard.write_bytes(bytes(data))
  caplog.clear()
  assert run.main(["verify"] + base + ["--allow_unverified"]) == 2
  assert f"{shard}: its bytes differ from when it was written (crc32)" in caplog.text
  shard.write_bytes(bytes(data[:-2]))
  with pytest.raises(DataError, match=r"logits\.npy: \d+ bytes, \d+ when it was written: the "
                                      r"teacher logits file is damaged; delete .* run `run\.py teacher`"):
    TeacherLogits(logits, data="d", length=5)
  manifest = json.loads((logits / "manifest.json").read_text())
  del manifest["checksums"]  # as written by an older dpjax
  (logits / "manifest.json").write_text(json.dumps(manifest))
  caplog.clear()
  assert run.main(["verify"] + base) == 2
  assert f"{logits}: unverified (written before digests were recorded)" in caplog.text
  assert run.main(["verify"] + base + ["--allow_unverified"]) == 0


def test_search_refuses_a_same_size_zeroed_index(trained, tmp_path, caplog, capsys,
                                                 monkeypatch):
  """`run.py search` answered from a faiss index whose middle was zeroed: it did not check the
  contents (eval and serve did). Stamps of an earlier intact search do not hide the damage."""
  monkeypatch.setattr(dpjax.io, "STAMP_SETTLE_NS", 0)  # the copies were just made
  workdir, base = _copy(trained, tmp_path)
  search = ["search"] + base + ["--query", "Where is the river?"]
  assert run.main(search) == 0
  assert "Q: Where is the river?" in capsys.readouterr().out
  path = workdir / "dump" / "indexes" / "Flat" / "index.faiss"
  assert json.loads((path.parent / dpjax.io.STAMP).read_text())["files"]["index.faiss"]
  size = path.stat().st_size
  _zero_block(path)
  assert path.stat().st_size == size
  caplog.clear()
  assert run.main(search) == 2
  errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
  assert len(errors) == 1 and errors[0].startswith(f"{path}: its bytes differ"), errors
  assert "\n" not in errors[0] and "Q:" not in capsys.readouterr().out


def test_a_stamped_file_is_read_again_only_once_changed(trained, tmp_path, monkeypatch):
  """A verified stamp spares an unchanged file the reading of every byte at the next start;
  a file written again (same bytes, new times), a damaged stamp or `run.py verify` read it."""
  monkeypatch.setattr(dpjax.io, "STAMP_SETTLE_NS", 0)
  workdir, base = _copy(trained, tmp_path)
  read = []
  checksum = dpjax.io.file_checksum
  monkeypatch.setattr(dpjax.io, "file_checksum", lambda path: (read.append(pathlib.Path(path)),
                                                               checksum(path))[1])
  search = ["search"] + base + ["--query", "Where is the river?"]
  index = workdir / "dump" / "indexes" / "Flat" / "index.faiss"
  shard = workdir / "dump" / "shard_00000" / "vectors.npy"
  assert run.main(search) == 0
  assert index in read and shard in read and any("checkpoints" in p.parts for p in read)
  read.clear()
  assert run.main(search) == 0
  assert read == []
  index.write_bytes(index.read_bytes())  # the same bytes, written again
  assert run.main(search) == 0
  assert read == [index]
  read.clear()
  (shard.parent / dpjax.io.STAMP).write_text('{"version": 1, "files": [')  # a torn stamp
  assert run.main(search) == 0
  assert set(read) == set(shard.parent.iterdir()) - {shard.parent / n for n in (
      dpjax.io.STAMP, "shard.json")}
  read.clear()
  assert run.main(["verify"] + base) == 0
  assert index in read and shard in read


def test_filter_head_digest_is_checked(tmp_path):
  kernel, bias = np.ones((12, 2), np.float32), np.zeros(2, np.float32)
  save_filter_head(tmp_path, kernel, bias)
  read_filter_head(tmp_path / FILTER_HEAD)
  with np.load(tmp_path / FILTER_HEAD) as saved:
    sha = saved["sha"]
  np.savez(tmp_path / FILTER_HEAD, kernel=kernel, bias=bias + 1, sha=sha)
  with pytest.raises(DataError, match="filter_head.npz: its arrays differ from the digest"):
    read_filter_head(tmp_path / FILTER_HEAD)
  np.savez(tmp_path / FILTER_HEAD, kernel=kernel, bias=bias)  # an older head: no digest
  read_filter_head(tmp_path / FILTER_HEAD)
