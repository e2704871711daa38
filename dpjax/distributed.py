"""Running one program on many processes/hosts with JAX's multi-controller runtime.

Every process runs the same `run.py` command. `initialize` connects them (`jax.distributed`);
afterwards `jax.devices()` lists the devices of all processes, the training mesh spans them,
each process feeds its own rows of every global batch, and only process 0 writes logs, metrics
and result files (Orbax coordinates the checkpoint writes itself). Work that needs no
communication (encoding a corpus for the dump, adding vectors to an index) is split into
disjoint, deterministic shares by `process_share`.

  # explicit (any machines, including several processes on one CPU host):
  python run.py train ... --coordinator 10.0.0.1:1234 --num_processes 2 --process_id 0
  # cluster environments JAX detects by itself (SLURM, Open MPI, Cloud TPU pods, ...):
  python run.py train ... --distributed
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time

import jax
from jax.experimental import multihost_utils

from dpjax.errors import ConfigError, Preempted

log = logging.getLogger(__name__)


CACHE_ENV = "DPJAX_COMPILATION_CACHE"


def enable_compilation_cache() -> str | None:
  """Turns on JAX's persistent compilation cache (before the first compilation): a resumed
  training, a dump after the training, a second eval or server start load their XLA
  executables from disk instead of compiling them again. Returns the folder (None: off).

  Where: JAX_COMPILATION_CACHE_DIR if set (JAX reads it itself), else $DPJAX_COMPILATION_CACHE,
  else ~/.cache/dpjax/xla ($XDG_CACHE_HOME honoured); DPJAX_COMPILATION_CACHE=off turns it off.
  The cache is trusted code: keep it in a folder only you can write.
  """
  path = compilation_cache_folder()
  if path is None:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  # A size cap turns on the cache's file lock (processes sharing it never read a half-written
  # entry) and least-recently-used eviction.
  if jax.config.jax_compilation_cache_max_size <= 0:
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX's is one second
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  return path


def compilation_cache_folder() -> str | None:
  """The folder `enable_compilation_cache` turns the cache on in (None: turned off)."""
  setting = os.environ.get(CACHE_ENV, "")
  if setting.lower() in ("0", "off", "false", "no"):
    return None
  home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return jax.config.jax_compilation_cache_dir or setting or os.path.join(home, "dpjax", "xla")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, auto: bool = False, timeout: int = 300) -> bool:
  """Joins the multi-process runtime when asked; returns whether it did.

  Args:
    coordinator: "host:port" of process 0's coordination service.
    num_processes, process_id: this job's size and this process's rank.
    auto: let JAX read the cluster environment (SLURM, Open MPI, TPU pod metadata, ...).
    timeout: seconds to wait for the coordinator and every process (then a ConfigError).
  """
  explicit = [coordinator, num_processes, process_id]
  if not auto and all(x is None for x in explicit):
    return False
  if not auto and any(x is None for x in explicit):
    raise ConfigError("--coordinator, --num_processes and --process_id go together "
                      "(or use --distributed to read them from the cluster environment)")
  if not auto and not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id {process_id} must be in 0 .. {num_processes - 1}")
  # Cross-process collectives of the CPU backend (for CPU-only hosts and tests); other
  # backends use their own (NCCL, ICI) and ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  log.info("process %s of %s: waiting up to %d s for the coordinator %s and the other processes",
           process_id, num_processes, timeout, coordinator or "(from the cluster environment)")
  if not auto and process_id != 0:
    # JAX aborts the process (no Python exception) when the coordinator never answers.
    _wait_for(coordinator, timeout)
  try:
    if auto:
      jax.distributed.initialize(initialization_timeout=timeout)
    else:
      jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                 process_id=process_id, initialization_timeout=timeout)
  except Exception as e:  # JAX raises a bare RuntimeError / XlaRuntimeError on a time-out
    raise ConfigError(f"could not join the job of coordinator {coordinator or '(cluster)'} "
                      f"within {timeout} s: {str(e).splitlines()[0][:300]}") from None
  log.info("process %d of %d: %d local devices, %d global", jax.process_index(),
           jax.process_count(), jax.local_device_count(), jax.device_count())
  if jax.process_index() != 0:  # one process speaks for the job
    logging.getLogger().setLevel(logging.WARNING)
  return True


def _wait_for(coordinator: str, timeout: float) -> None:
  """Waits until the coordinator's port accepts connections (a ConfigError after `timeout` s)."""
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError(f"--coordinator {coordinator!r} is not host:port")
  deadline = time.monotonic() + timeout
  while True:
    try:
      socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
      return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise ConfigError(f"could not join the job of coordinator {coordinator} within "
                          f"{timeout} s ({e.strerror or e}): is process 0 running there, and "
                          "is the address right?") from None
      time.sleep(0.5)


def is_main() -> bool:
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (no-op in a single process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def process_share(item: int) -> bool:
  """Whether work item `item` (a shard number) belongs to this process (round-robin)."""
  return item % jax.process_count() == jax.process_index()


def many_processes() -> bool:
  return jax.process_count() > 1


def exit_for(error: BaseException) -> int:
  """The exit of an expected error: 143 for a preemption stop (`Preempted`: every process stopped
  after the same step, so they leave together), else 2 at once."""
  return exit_together(143) if isinstance(error, Preempted) else exit_now(2)


def exit_together(code: int) -> int:
  """In a multi-process job where every process stops at the same point (a preemption stop: JAX's
  sync point makes all of them stop after one step), leaves through JAX's shutdown barrier, then
  exits: process 0 hosts the coordination service, and exiting before the others have
  disconnected makes their agents abort (status -6 instead of `code`). In a single process,
  returns `code`."""
  if many_processes():
    try:
      jax.distributed.shutdown()
    except Exception as e:  # e.g. the barrier timed out: exit with `code` all the same
      logging.warning("jax.distributed.shutdown: %s", e)
  return exit_now(code)


def exit_now(code: int) -> int:
  """In a multi-process job, exits at once (no shutdown barrier the other processes would never
  reach): the coordination service then ends the whole job instead of letting it hang. In a
  single process, returns `code`."""
  if many_processes():
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code
