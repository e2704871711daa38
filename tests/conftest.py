"""Test set-up: 8 forced CPU devices (so sharding is really exercised) before jax starts."""
import os
import pathlib

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for the network
REPO = pathlib.Path(__file__).resolve().parents[1]
os.chdir(REPO)  # configs (`experiments/demo.py:tiny`) and data paths are relative to the repo
# One compilation cache for the whole run (both xdist workers and every `run.py` subprocess):
# the many tiny trainings, dumps and evals compile the same programs; each compiles once.
os.environ.setdefault("DPJAX_COMPILATION_CACHE", str(REPO / ".pytest_cache" / "xla"))

import pytest  # noqa: E402

from dpjax.distributed import enable_compilation_cache  # noqa: E402

enable_compilation_cache()  # for the tests that call the library in-process
SHARED_DATA = pathlib.Path(os.environ.get("DPJAX_SHARED_DATA", REPO.parent / "shared" / "data"))
FIXTURES = REPO / "tests" / "fixtures"


def phrase_questions(vectors, count: int, seed: int):
  """(q_start, q_end) [count, D] made of a dump's own token vectors [N, D]: a token's start half
  and the end half of a token up to 3 after it (phrases an exact index knows the answers of)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  vectors = np.asarray(vectors, np.float32)
  n, dim = vectors.shape
  starts = rng.choice(n - 4, count, replace=False)
  ends = starts + rng.integers(0, 4, count)
  q_start, q_end = np.zeros((count, dim), np.float32), np.zeros((count, dim), np.float32)
  q_start[:, :dim // 2] = vectors[starts, :dim // 2]
  q_end[:, dim // 2:] = vectors[ends, dim // 2:]
  return q_start, q_end


def load_script(relative: str):
  """An experiment script (not a package module), e.g. `experiments/studies/report_qsft_filter.py`."""
  import importlib.util
  path = REPO / relative
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="session")
def squad_dir() -> pathlib.Path:
  """The SQuAD v1.1 files (`../shared/data/squad`, or $DPJAX_SHARED_DATA/squad)."""
  path = SHARED_DATA / "squad"
  if not (path / "dev-v1.1.json").is_file():
    pytest.skip(f"SQuAD data not found under {path} (set DPJAX_SHARED_DATA)")
  return path


@pytest.fixture(scope="session")
def tokenizer():
  from dpjax.data import Tokenizer
  return Tokenizer.from_pretrained("minilm-l6")


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
  from dpjax.models import resolve_model_dir
  return resolve_model_dir("minilm-l6")


@pytest.fixture(scope="session")
def tiny_workdir(tmp_path_factory) -> pathlib.Path:
  """One trained tiny workdir per test process (`experiments/demo.py:tiny`): trained, its corpus
  dumped and a Flat index built. Tests that write into it work on a copy
  (`shutil.copytree`)."""
  import run
  workdir = tmp_path_factory.mktemp("tiny") / "demo"
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0, mode
  return workdir
