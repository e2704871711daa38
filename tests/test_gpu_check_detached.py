"""experiments/gpu_check_detached.sh: a check run detached, brought back in two commands."""
import json
import os
import pathlib
import subprocess
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[1]
# Stands in for python3 on the device: writes a JSON at once, a log, then takes a few seconds.
FAKE_PYTHON = """#!/bin/sh
while [ $# -gt 0 ]; do
  case $1 in --workdir) work=$2;; --json) json=$2;; esac; shift
done
mkdir -p "$work/logs" "$work/default"
echo '{"stages": {"default.train": {"rc": 0}}}' > "$json"
tuned=$DPJAX_COMPILATION_CACHE/xla_gpu_per_fusion_autotune_cache_dir
ls "$tuned" > "$work/logs/default.train.log"
echo result > "$tuned/this_run.textproto"
echo '{"step": 1}' > "$work/default/metrics.jsonl"
sleep 4
echo '{"stages": {"default.train": {"rc": 0}, "default.dump": {"rc": 0}}}' > "$json"
exit 3
"""


def _run(tmp_path, *args) -> str:
  env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
         "W": str(tmp_path / "w"), "OUT": str(tmp_path / "out"),
         "DPJAX_COMPILATION_CACHE": str(tmp_path / "cache"),
         "AUTOTUNE": str(tmp_path / "earlier.tgz")}
  done = subprocess.run(["bash", "experiments/gpu_check_detached.sh", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  return done.stdout


def test_start_brings_back_what_is_done_and_collect_the_rest(tmp_path):
  """Each command brings back what the check wrote so far, and the autotuning results: an
  earlier run's, unpacked before the check started, with this run's."""
  tuned = tmp_path / "earlier" / "xla_gpu_per_fusion_autotune_cache_dir"
  tuned.mkdir(parents=True)
  (tuned / "earlier_run.textproto").write_text("result")
  with tarfile.open(tmp_path / "earlier.tgz", "w:gz") as tar:
    tar.add(tuned, arcname=tuned.name)
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "python3").write_text(FAKE_PYTHON)
  (tmp_path / "bin" / "python3").chmod(0o755)
  (tmp_path / "out").mkdir()
  out = _run(tmp_path, "start", "1", "--stages", "train")
  assert "still running" in out
  first = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
  assert list(first["stages"]) == ["default.train"]
  with tarfile.open(tmp_path / "out" / "runs.tgz") as tar:
    assert {"logs/default.train.log", "default/metrics.jsonl"} <= set(tar.getnames())
    assert tar.extractfile("logs/default.train.log").read() == b"earlier_run.textproto\n"
  with tarfile.open(tmp_path / "out" / "autotune.tgz") as tar:
    assert {f"{tuned.name}/{n}_run.textproto" for n in ("earlier", "this")} <= set(
        tar.getnames())
  out = _run(tmp_path, "collect", "30")
  assert "finished: exit status 3" in out
  assert list(json.loads((tmp_path / "out" / "gpu_check.json").read_text())["stages"]) == [
      "default.train", "default.dump"]
