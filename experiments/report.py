"""Report helpers of the experiment scripts: results JSON + Markdown naming the command."""
from __future__ import annotations

import pathlib
import shlex
import sys
from typing import Sequence

from dpjax.io import write_json, write_text_atomic
from dpjax.metrics import mcnemar_p  # noqa: F401 (the experiments' paired test, from here)


class Elided(str):
  """A `--flag ...` placeholder of elide_notes: printed as is, never shell-quoted."""


def command_line(script: str, argv: Sequence[str]) -> str:
  """`python SCRIPT ARGS` as a shell can run it (arguments quoted; elided notes shown as is)."""
  return " ".join(["python", script,
                   *(a if isinstance(a, Elided) else shlex.quote(a) for a in argv)])


def elide_notes(argv: Sequence[str], flags=("--note",)) -> list[str]:
  """A command line with the values of note flags (prose printed in the report) shown as `...`."""
  shown, rest = [], list(argv)
  while rest:
    arg = rest.pop(0)
    if arg in flags:
      if rest:
        rest.pop(0)
      if f"{arg} ..." not in shown:
        shown.append(Elided(f"{arg} ..."))
    else:
      shown.append(arg)
  return shown


def with_notes(lines: Sequence[str], notes: Sequence[str]) -> str:
  """A report's markdown: its lines, then each note (`--note`) as its own paragraph."""
  return "\n".join([*lines, *(part for note in notes for part in ("", note))]) + "\n"


def save_results(out, results: dict, render, script: str, argv=None) -> "pathlib.Path":
  """Writes `results` as JSON to `out` and `render(results, command)` as Markdown beside it
  (`command`: how the script was run); prints the Markdown; returns the JSON path."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  write_json(out, results)
  command = command_line(script, sys.argv[1:] if argv is None else argv)
  write_text_atomic(out.with_suffix(".md"), render(results, command))
  print(out.with_suffix(".md").read_text())
  return out


def p_text(p: float | None) -> str:
  """A p-value to 3 significant digits; one below the smallest double reads `< 1e-300`."""
  if p is None:
    return "-"
  return "< 1e-300" if p == 0 else f"{p:.3g}"
