"""Every Python block of README.md and docs/*.md runs as written, on a tiny trained workdir.

The blocks name the demo's paths (`workdirs/demo`, its custom dump, `workdirs/demo-export`, the
config `experiments/demo.py`): the test makes them in a temporary folder from the tiny config and
points the block's paths there, then executes the block. A block that defines a searcher must
also answer a question with it.
"""
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

import run

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_PYTHON = re.compile(r"^```python\s*\n(.*?)^```", re.M | re.S)


def python_blocks() -> list[tuple[str, int, str]]:
  """(file, line, code) of each fenced Python block of the docs."""
  found = []
  for doc in DOCS:
    text = doc.read_text()
    for match in _PYTHON.finditer(text):
      found.append((doc.name, text[:match.start()].count("\n") + 1, match.group(1)))
  return found


def test_the_docs_have_python_blocks():
  assert {name for name, _, _ in python_blocks()} >= {"README.md", "indexing.md"}


@pytest.fixture(scope="module")
def demo(tiny_workdir, tmp_path_factory):
  """The paths the blocks name, made from the tiny config: the workdir with a `custom` dump and
  its Flat index, and the exported encoders."""
  root = tmp_path_factory.mktemp("docs")
  workdir = root / "demo"
  shutil.copytree(tiny_workdir, workdir)
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  for mode in ("dump", "index"):
    assert run.main([mode] + base + ["--set", "index.dump_name=custom"]) == 0, mode
  assert run.main(["export"] + base + ["--out", str(root / "demo-export")]) == 0
  return root


# Run after the block in its process: a searcher it made answers a question.
_CHECK = """
if "searcher" in dir():
  found = searcher.search(["where was the river?"], k=3)
  assert len(found) == 1 and len(found[0]) == 3, found
"""


@pytest.mark.slow
@pytest.mark.parametrize("name,line,code", python_blocks(),
                         ids=[f"{n}:{l}" for n, l, _ in python_blocks()])
def test_python_block_runs(demo, name, line, code):
  """In a fresh interpreter, as a reader would run it (this process has imported much of dpjax
  already, which would hide a block's missing import)."""
  code = (code.replace("workdirs/demo-export", str(demo / "demo-export"))
          .replace("workdirs/demo", str(demo / "demo"))
          .replace('"experiments/demo.py"', '"experiments/demo.py:tiny"'))
  result = subprocess.run([sys.executable, "-c", code + _CHECK], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, f"{name}:{line}\n{result.stderr[-3000:]}"
