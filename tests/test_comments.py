"""Comments and docstrings say what code does and why; measured figures live in results/.

A timing, an accuracy, a delta between two runs or a p-value quoted in a comment goes stale as
the code and the machines change, and cannot be traced to a command; the code points to the
results file instead (results/code_measurements.md collects the figures behind code choices).
"""
import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("dpjax/**/*.py"), *ROOT.glob("experiments/**/*.py"), ROOT / "run.py"])

# A number, not part of a word or a name (bm25s, float16, R0.1, EM@10, Top-20), optionally
# approximate (~).
_NUMBER = r"(?<![\w.@])(?<![Tt]op-)~?\d(?:[\d,.]*\d)?"
# A score a measurement reports, named as the results files name them.
_METRIC = r"\b(?:EM|F1|(?:EM|F1|MRR|P|recall)@\d+|Top-\d+|MRR|AUC(?:-PR|-ROC)?|accuracy)\b"
# Words of a comparison between two runs, or of a gain or a loss.
_COMPARED = r"vs\.?|versus|against|instead of"
_CHANGE = r"(?:slower|faster|more|less|fewer|longer|shorter|higher|lower|cheaper)\b"
FIGURE = re.compile("|".join([
    # a timing, or a throughput
    rf"{_NUMBER}\s?k?\s?(?:s|seconds|min|minutes|ms|us|µs|ns)\b(?![/@-])",
    rf"{_NUMBER}\s?k?\s?(?:stored |encoded )?(?:tokens|questions|q|windows|examples|steps"
    rf"|passages|queries|requests|elements)/s\b",
    rf"{_NUMBER}\s?(?:s|ms)/step\b",
    rf"{_NUMBER}\s?[GMT]?FLOPS\b",
    rf"{_NUMBER}\s?[KMGT]i?B/s\b",
    # a speed-up ratio
    rf"{_NUMBER}\s?x (?:faster|slower|cheaper|the|as fast)\b",
    # an accuracy figure: EM 42.6, EM@1 -0.58, Top-20: 88.5
    rf"{_METRIC}\s?[:=]?\s?[-+]?{_NUMBER}(?![\d,.]*\s?(?:questions|passages|windows|tokens))",
    # a delta: 42.6 vs 33.5, 23.40 -> 22.45, 0.95 s instead of 1.56 s
    # (up to three unit words between, none a number: "24 loses Top-20 against 32" compares
    # two settings, not two measurements)
    rf"{_NUMBER}\s?%?(?:\s[A-Za-zµ/]+){{0,3}}\s(?:{_COMPARED})\s[-+]?{_NUMBER}",
    rf"{_NUMBER}\s?%?\s?(?:->|→)\s?[-+]?{_NUMBER}",
    # a measured share: 13% slower, ~20% more, ~1% of
    rf"{_NUMBER}\s?%\s{_CHANGE}",
    rf"(?<![\w.])~\d(?:[\d.]*\d)?\s?%",
    # a p-value
    r"\bp\s?[=<]\s?\d",
]))


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


def test_no_measured_figures_in_comments():
  hits = [f"{path.relative_to(ROOT)}:{hit}"
          for path in FILES for hit in figures(path.read_text(encoding="utf-8"))]
  assert not hits, "figures belong in results/*.md:\n" + "\n".join(hits)


@pytest.mark.parametrize("text", [
    # timings and throughputs
    "# took 38 ms against 134", "# 3,480 stored tokens/s", "# 1.35 s/step", "# 386 s",
    '"""Encodes 64 questions in 0.95 s."""', "# ~100k tokens/s", "# ~0.1-0.3 ns an element",
    "# 1.1 ns an element", "# 57 ms a call", "# 145 -> 158 GFLOPS", "# 20.6 questions/s",
    # speed-ups and measured shares
    "# 1.6x faster here", "# 13% slower at 8,192", "# ~20% more steps in the same time",
    "# 11-13% less time", "# ~1% of the largest value",
    # accuracy figures
    "# EM 42.6", "# full-corpus EM@1 24.0", "# Top-20 88.5", "# F1 61.2", "# EM@1 -0.58 at 384",
    "# (EM 0 against it)", "# MRR@20: 31.2", "# AUC-PR 0.09",
    # deltas between runs
    "# RC (42.6 vs 33.5)", "# (23.40 -> 22.45 at 4,000 questions)", "# (0.041 -> 0.091)",
    "# EM@1 31.65 vs 31.85 (results/dump_bf16.md)", "# 0.31 instead of 0.42 s",
    "# 4,016 against 4,291 stored tokens", "# 2.62 us per token against 3.46",
    # p-values
    "# (p = 0.22)", "# p < 1e-3"])
def test_figures_are_found(text):
  assert figures(text + "\n")


@pytest.mark.parametrize("text", [
    # configuration values and constants
    "# lr 3e-5", "# batch 12", "# 1,500 steps", "# 384/128 windows", "# float16 vectors",
    "# d=384", "# 1 << 22", "# bm25s, k1 0.9 and b 0.4", "# [64, 192] x 12", "# 384 x 2 layer",
    "# lambda_inb = lambda_prb = 256, lr 3e-5", "# 4 epochs, lr 1e-4", "# 2,000 steps",
    "# 3 shapes to compile, not 12", "# a batch of one, not 64", "# warm-up over 10% of the steps",
    "# thresholds keeping 100%, 75%, 50%", "# resident memory grown by less than 10%",
    "# the last window's p99 within 1.5x of the first's", "# 1.5 + 3 MiB at D = 384",
    # names of measures and settings, not their values
    "# passage Top-1/5/20, MRR@20, questions/s", "# passage Top-1/5/20/100 up to k",
    "# dev EM@1 on a random 2,000", "# EM@1 / Top-20 within noise", "# top-10 phrases",
    "# McNemar's exact test", "# EM@1, EM@10 of the top phrases", "# Top-100: eval.passage_k=100",
    "# the schedule at p99", "# seconds per step (s/step)",
    # arrows and comparisons of things that are not measurements
    "# 'R0.1' -> ('R', 0.1)", "# 'C0' -> ('C', 0)", "# uint32 -> uint32",
    "# before 2026-11-24 that say `squad.py:cpu`", "# status -6 instead of `code`",
    "# 16 or 8 lose EM@1, 24 loses Top-20 against 32"])
def test_other_numbers_are_not_figures(text):
  assert not figures(text + "\n")
