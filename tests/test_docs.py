"""Every command in README.md and docs/*.md runs as written.

The fenced shell blocks of the documentation are read command by command: a `run.py` (or
`dpjax`) command must parse with `dpjax.cli.parse` and its `--config` file, `:arg` and `--set`
overrides must load with `dpjax.config.load_config`; a script (`python experiments/x.py`,
`python -m dpjax.x`) must exist and define every `--flag` the doc passes; `bash x.sh` must name
a file; `make X` a Makefile target. Nothing is run or trained.
"""
import ast
import contextlib
import io
import pathlib
import re
import shlex

import pytest

from dpjax import cli
from dpjax.config import load_config
from dpjax.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(bash|sh|shell|console)\s*\n(.*?)^```", re.M | re.S)
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_PYTHONS = re.compile(r"(^|/)(python3?|\$PY|\$\{PY\})$")


def shell_blocks(text: str) -> list[str]:
  return [match.group(2) for match in _FENCE.finditer(text)]


def _one_line(block: str) -> str:
  """The block with comments dropped, continuations joined, and newlines outside quotes as `;`
  (a quoted value may span lines)."""
  text, out, quote, i = re.sub(r"\\\n", " ", block), [], None, 0
  while i < len(text):
    ch = text[i]
    if quote:
      quote = None if ch == quote else quote
      out.append(" " if ch == "\n" else ch)
    elif ch in "'\"":
      quote = ch
      out.append(ch)
    elif ch == "#" and (i == 0 or text[i - 1].isspace()):
      while i < len(text) and text[i] != "\n":
        i += 1
      continue
    else:
      out.append(";" if ch == "\n" else ch)
    i += 1
  return "".join(out)


def commands(block: str) -> list[list[str]]:
  """The simple commands of a shell block: continuations joined, comments dropped, split at
  `;`, `&&`, `||`, `|` and `&`, variables assigned in the block (`S='...'`) expanded."""
  lexer = shlex.shlex(_one_line(block), posix=True, punctuation_chars=";&|")
  lexer.whitespace_split, lexer.commenters = True, ""
  variables, found, current = {}, [], []
  for token in [*lexer, ";"]:
    if token and set(token) <= set(";&|"):
      if current:
        found.append(current)
      current = []
    else:
      current.append(token)
  expanded = []
  for words in found:
    if len(words) == 1 and _ASSIGN.match(words[0]):
      name, value = _ASSIGN.match(words[0]).groups()
      variables[name] = value
      continue
    out = []
    for word in words:
      name = word[1:].strip("{}") if word.startswith("$") else None
      out.extend(variables[name].split() if name in variables else [word])  # as bash splits
    expanded.append(out)
  return expanded


def _script_flags(path: pathlib.Path) -> set[str]:
  """The `--flags` a script's argparse defines (string constants of add_argument calls), its
  own and those of the modules beside it that it imports from (shared arguments)."""
  flags = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"):
      flags |= {a.value for a in node.args
                if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      sibling = path.parent / f"{node.module}.py"
      if sibling.is_file() and sibling != path:
        flags |= _script_flags(sibling)
  return flags


def _check_run(args: list[str]) -> None:
  with contextlib.redirect_stderr(io.StringIO()) as err:
    try:
      parsed = cli.parse(args)
    except SystemExit:
      raise AssertionError(f"run.py {' '.join(args)}: {err.getvalue().strip()}") from None
  if parsed.config is None:  # the workdir's saved config: the docs' workdirs are the demo's
    parsed.config = "experiments/demo.py"
  config = pathlib.Path(parsed.config.partition(":")[0])
  spec = str(ROOT / config) + parsed.config[len(str(config)):]
  load_config(spec, parsed.set)  # unknown file, arg or --set key: ConfigError


def _check_script(program: pathlib.Path, args: list[str]) -> None:
  assert program.is_file(), f"no such script: {program.relative_to(ROOT)}"
  flags = _script_flags(program)
  for arg in args:
    flag = arg.partition("=")[0]
    if flag.startswith("--") and flag not in flags:
      raise AssertionError(f"{program.relative_to(ROOT)} has no flag {flag}")


def check_command(words: list[str]) -> str | None:
  """Checks one command; returns what kind it was (None: not a command of this project)."""
  while words and _ASSIGN.match(words[0]):  # VAR=value prefixes
    words = words[1:]
  if words[:1] in (["srun"], ["taskset"]):
    words = words[1:] if words[0] == "srun" else words[2:]
  if not words:
    return None
  head, rest = words[0], words[1:]
  if head == "dpjax":
    _check_run(rest)
    return "run"
  if _PYTHONS.search(head):
    if rest[:1] == ["-m"] and rest[1].startswith("dpjax"):
      module = ROOT / (rest[1].replace(".", "/") + ".py")
      _check_script(module, rest[2:])
      return "module"
    if rest and rest[0].endswith("run.py"):
      _check_run(rest[1:])
      return "run"
    if rest and rest[0].endswith(".py"):
      _check_script(ROOT / rest[0], rest[1:])
      return "script"
    return None
  if head == "bash" and rest and rest[0].endswith(".sh"):
    assert (ROOT / rest[0]).is_file(), f"no such script: {rest[0]}"
    return "bash"
  if head == "make":
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
    for target in (w for w in rest if "=" not in w and not w.startswith("-")):
      assert target in targets, f"no make target {target}"
    return "make"
  return None


def doc_commands():
  for doc in DOCS:
    for block in shell_blocks(doc.read_text(encoding="utf-8")):
      for words in commands(block):
        yield doc.relative_to(ROOT), words


def test_docs_exist():
  assert (ROOT / "docs").is_dir() and len(DOCS) > 5


@pytest.mark.parametrize("doc,words", list(doc_commands()),
                         ids=lambda x: " ".join(x)[:60] if isinstance(x, list) else str(x))
def test_doc_command(doc, words):
  check_command(words)


def test_docs_run_commands_are_checked():
  kinds = [check_command(words) for _, words in doc_commands()]
  assert kinds.count("run") >= 20 and "make" in kinds and "script" in kinds


@pytest.mark.parametrize("bad", [
    "python run.py trian --config experiments/demo.py --workdir W",
    "python run.py train --config experiments/nope.py --workdir W",
    "python run.py train --config experiments/squad.py:gpu --workdir W",
    "python run.py train --config experiments/demo.py --workdir W --set train.nope=1",
    "python run.py train --config experiments/demo.py --workdir W --frobnicate",
    "python experiments/studies/dump_windows.py --no-such-flag 3",
    "python experiments/no_such_script.py",
    "bash experiments/no_such.sh",
    "make no-such-target",
    "S='--config experiments/demo.py --workdir W --set index.nope=1'\npython run.py dump $S",
])
def test_bad_commands_fail(bad):
  with pytest.raises((AssertionError, ConfigError)):
    for words in commands(bad):
      check_command(words)


def test_configs_page_names_every_field():
  page = (ROOT / "docs" / "configs.md").read_text(encoding="utf-8")
  missing = []
  for spec in ("experiments/demo.py", "experiments/squad.py"):
    def walk(node, prefix=""):
      for key, value in node.items():
        if hasattr(value, "items"):
          yield from walk(value, f"{prefix}{key}.")
        else:
          yield prefix + key
    missing += [key for key in walk(load_config(str(ROOT / spec))) if f"`{key}`" not in page]
  assert not missing, f"docs/configs.md lacks {sorted(set(missing))}"


def test_readme_is_a_guide():
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  assert len(text.splitlines()) <= 300 and len(text.encode()) <= 25_000
  assert not re.search(r"\bp\s?[=<]\s?\d|McNemar|\b20\d\d-\d\d-\d\d\b", text)


def test_results_index_names_every_results_file():
  index = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
  missing = [path.name for path in (ROOT / "results").iterdir() if path.name != "README.md"
             and f"`{path.name}" not in index and f"`{path.stem}." not in index]
  assert not missing, f"results/README.md does not list {missing}"
