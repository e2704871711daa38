"""Comments and docstrings say what code does and why; measured figures live in results/.

A timing or a p-value quoted in a comment goes stale as the code and the machines change, and
cannot be traced to a command; the code points to the results file instead
(results/code_measurements.md collects the figures behind code choices).
"""
import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("dpjax/**/*.py"), *ROOT.glob("experiments/*.py"),
                *ROOT.glob("experiments/studies/*.py"), *ROOT.glob("experiments/benchmarks/*.py")])

# A number (not part of a word such as bm25s) followed by a unit of time or throughput, a
# p-value, or a speed-up ratio.
_NUMBER = r"(?<![\w.])\d(?:[\d,.]*\d)?\s?k?"
FIGURE = re.compile(
    rf"{_NUMBER}\s?(?:s|seconds|min|minutes|ms|us)\b(?![/@-])"
    rf"|{_NUMBER}\s?(?:stored |encoded )?(?:tokens|questions|q|windows|examples|steps)/s\b"
    rf"|{_NUMBER}\s?s/step"
    rf"|\bp\s?[=<]\s?\d"
    rf"|{_NUMBER}\s?x (?:faster|slower|cheaper|the)\b")


def narrative(source: str):
  """(line, text) of every comment and docstring line of a Python source."""
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      yield token.start[0], token.string
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        for offset, line in enumerate(doc.splitlines()):
          yield node.body[0].lineno + offset, line


def figures(source: str) -> list[str]:
  return [f"{line}: {text.strip()}" for line, text in narrative(source) if FIGURE.search(text)]


def test_no_timings_or_p_values_in_comments():
  hits = [f"{path.relative_to(ROOT)}:{hit}"
          for path in FILES for hit in figures(path.read_text(encoding="utf-8"))]
  assert not hits, "figures belong in results/*.md:\n" + "\n".join(hits)


@pytest.mark.parametrize("text", [
    "# took 38 ms against 134", "# 3,480 stored tokens/s", "# 1.35 s/step", "# (p = 0.22)",
    "# 1.6x faster here", '"""Encodes 64 questions in 0.95 s."""', "# ~100k tokens/s"])
def test_figures_are_found(text):
  assert figures(text + "\n")


@pytest.mark.parametrize("text", [
    "# bm25s, k1 0.9 and b 0.4", "# EM@1 31.65 vs 31.85 (results/dump_bf16.md)",
    "# passage Top-1/5/20, MRR@20, questions/s", "# McNemar's exact test", "# [64, 192] x 12"])
def test_other_numbers_are_not_figures(text):
  assert not figures(text + "\n")
