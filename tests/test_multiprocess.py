"""Two processes on localhost (CPU, 2 forced devices each) on JAX's distributed runtime.

The commands are those of docs/multihost.md: `run.py MODE ... --coordinator
127.0.0.1:PORT --num_processes 2 --process_id I`, with XLA_FLAGS forcing 2 CPU devices each.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import faiss
import numpy as np
import pytest

from conftest import REPO

CONFIG = "experiments/demo.py:tiny"
SETTINGS = ["--set", "index.shard_passages=7", "--set", "index.specs=['Flat','IVF8,SQ8']"]


def _env(devices: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  return env


PORT_TAKEN = "Failed to add port to server"  # gRPC, when process 0 cannot bind the coordinator


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(mode: str, workdir, *extra: str, processes: int,
            devices: int) -> list[tuple[subprocess.Popen, pathlib.Path]]:
  """Starts `run.py mode` as `processes` processes of `devices` devices each; (process, its
  output file) pairs."""
  command = [sys.executable, "run.py", mode, "--config", CONFIG, "--workdir", str(workdir),
             *extra]
  ranks = [[]]  # one process: no distributed runtime
  if processes > 1:
    address = f"127.0.0.1:{_free_port()}"
    ranks = [["--coordinator", address, "--num_processes", str(processes), "--process_id",
              str(rank)] for rank in range(processes)]
  launched = []
  for n, rank in enumerate(ranks):
    log = pathlib.Path(workdir).parent / f"{pathlib.Path(workdir).name}-{mode}-{n}.log"
    with log.open("w") as out:
      launched.append((subprocess.Popen(command + rank, cwd=REPO, env=_env(devices), stdout=out,
                                        stderr=subprocess.STDOUT, text=True), log))
  return launched


def _finish(launched, timeout: float = 600) -> list[str]:
  """Waits for every process; once one has failed (or the time is up), stops the others, which
  would wait for it until their own timeout. Their outputs."""
  deadline = time.monotonic() + timeout
  while any(p.poll() is None for p, _ in launched):
    if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p, _ in launched):
      for p, _ in launched:
        p.kill()
        p.wait()
    time.sleep(0.2)
  return [log.read_text() for _, log in launched]


def _run(mode: str, workdir, *, processes: int, devices: int, attempts: int = 3):
  """Runs `run.py mode` as `processes` processes of `devices` devices each; waits for all. A
  coordinator port taken between `_free_port` and process 0's bind is retried on another."""
  for attempt in range(attempts):
    launched = _launch(mode, workdir, *SETTINGS, processes=processes, devices=devices)
    outputs = _finish(launched)
    if not any(PORT_TAKEN in output for output in outputs):
      break
  for rank, ((process, _), output) in enumerate(zip(launched, outputs)):
    assert process.returncode == 0, f"{mode} process {rank} failed:\n{output[-4000:]}"
  return outputs


def _losses(workdir) -> list[float]:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.mark.slow
def test_two_processes_train_dump_and_merged_index(tmp_path):
  multi, single = tmp_path / "multi", tmp_path / "single"
  # Training: 2 processes x 2 devices == 1 process x 4 devices, same global batch of 8.
  _run("train", multi, processes=2, devices=2)
  _run("train", single, processes=1, devices=4)
  expected = _losses(single)
  assert len(expected) == 6  # tiny: 6 steps, the pre-batch queue active from step 3
  np.testing.assert_allclose(_losses(multi), expected, rtol=1e-5)
  assert (multi / "results.json").is_file() and (multi / "checkpoints" / "6").is_dir()

  # Dump: each process encodes its own shards; the result equals a one-process dump.
  _run("dump", multi, processes=2, devices=2)
  _run("dump", single, processes=1, devices=4)
  from dpjax.index.dump_reader import Dump
  two, one = Dump.load(multi / "dump"), Dump.load(single / "dump")
  assert two.manifest["processes"] == 2 and len(two.manifest["shards"]) >= 4
  assert [s["tokens"] for s in two.manifest["shards"]] == [
      s["tokens"] for s in one.manifest["shards"]]
  assert two.passages == one.passages
  np.testing.assert_array_equal(two.token_passage, one.token_passage)
  np.testing.assert_array_equal(two.char_spans, one.char_spans)
  np.testing.assert_allclose(two.vectors.astype(np.float32), one.vectors.astype(np.float32),
                             atol=2e-3, rtol=2e-3)

  # Index: built by 2 processes (parts merged by process 0) == built by one process.
  _run("index", multi, processes=2, devices=2)
  from dpjax.index.faiss_index import build_index
  queries = np.random.default_rng(0).standard_normal((16, two.vectors.shape[1]), np.float32)
  for name, spec in [("Flat", "Flat"), ("IVF8_SQ8", "IVF8,SQ8")]:
    merged_dir = multi / "dump" / "indexes" / name
    manifest = json.loads((merged_dir / "index_manifest.json").read_text())
    assert manifest["processes"] == 2 and manifest["num_tokens"] == len(two.vectors)
    alone_dir = build_index(multi / "dump", spec, name=f"one_process_{name}", nprobe=8)
    merged = faiss.read_index(str(merged_dir / "index.faiss"))
    alone = faiss.read_index(str(alone_dir / "index.faiss"))
    for index in (merged, alone):
      if "IVF" in spec:
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", 8)
    assert merged.ntotal == alone.ntotal == len(two.vectors)
    scores_m, ids_m = merged.search(queries, 10)
    scores_a, ids_a = alone.search(queries, 10)
    np.testing.assert_array_equal(ids_m, ids_a)
    np.testing.assert_allclose(scores_m, scores_a, rtol=1e-6)
    if spec == "Flat":  # labels are global token ids: the exact top-10 by brute force
      exact = np.argsort(-(queries @ two.vectors.astype(np.float32).T), axis=1)[:, :10]
      np.testing.assert_array_equal(ids_m, exact)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_with_a_checkpoint(tmp_path):
  """A preemption notice reaching one process: JAX's sync point stops every process after the
  same step, which is checkpointed; both exit with status 143."""
  import signal
  launched = _launch("train", tmp_path, "--set", "train.num_steps=400", "--set",
                     "train.checkpoint_every=1000", "--set", "train.log_every=1",
                     processes=2, devices=2)
  try:
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
      assert time.time() < deadline and all(p.poll() is None for p, _ in launched)
      time.sleep(0.5)
    launched[1][0].send_signal(signal.SIGTERM)
    for p, _ in launched:
      p.wait(timeout=300)
    outputs = [log.read_text() for _, log in launched]
  finally:
    for p, _ in launched:
      p.kill()
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
  assert len(steps) == 1 and 3 <= steps[0] < 400
  for (process, _), output in zip(launched, outputs):
    assert process.returncode == 143, output[-3000:]
    assert f"stopped on SIGTERM at step {steps[0]} of 400" in output


@pytest.mark.slow
def test_a_coordinator_port_taken_before_its_bind_is_retried(tmp_path, monkeypatch):
  """`_free_port`'s port can be taken before process 0 binds it (another program, rarely): the
  run fails fast (process 0 cannot start the coordinator; the other, waiting for it, is stopped)
  and starts again on another port."""
  free, ports = _free_port, []
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(sys.modules[__name__], "_free_port",
                        lambda: ports.append(free() if ports else taken.getsockname()[1])
                        or ports[-1])
    start = time.monotonic()
    outputs = _run("data", tmp_path / "w", processes=2, devices=1)
  assert len(ports) == 2 and time.monotonic() - start < 120  # not the 300 s init timeout
  assert not any(PORT_TAKEN in output for output in outputs)
  assert (tmp_path / "w-data-0.log").is_file()
