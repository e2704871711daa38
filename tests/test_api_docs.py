"""The API reference builds from the docstrings with pdoc, as docs/api.md says.

The public modules are rendered once into a temporary folder with pdoc's Python API; the tests
check that pdoc warned of nothing, that each module has its page, that every public class,
function, method and property a module defines is on its page (the entry points the docs name,
by name), that no more of them lack a docstring than UNDOCUMENTED lists, and that docs/api.md's
command names the same modules. Nothing is kept.
"""
import importlib
import inspect
import pathlib
import re
import shlex
import warnings

import pdoc
import pdoc.render
import pytest

from conftest import REPO

# The modules a user imports, in docs/api.md's order (its command lists the same); the others
# are reached through run.py.
PUBLIC_MODULES = [
    "dpjax.config", "dpjax.settings", "dpjax.main", "dpjax.errors", "dpjax.workdir", "dpjax.loading",
    "dpjax.losses", "dpjax.metrics", "dpjax.reading",
    "dpjax.models.bert", "dpjax.models.densephrases", "dpjax.models.reader",
    "dpjax.data.squad", "dpjax.data.corpus", "dpjax.data.questions", "dpjax.data.windows",
    "dpjax.data.tokenization",
    "dpjax.index.dump_reader", "dpjax.index.phrase_index", "dpjax.index.search",
    "dpjax.index.rescoring", "dpjax.index.hybrid", "dpjax.index.sparse", "dpjax.index.evaluate",
]

# The names README.md and docs/ send a user to, by module (`Class.method` for a method).
KEY_NAMES = {
    "dpjax.losses": ["single_passage_loss", "distillation_loss", "in_batch_loss",
                     "unified_loss", "filter_loss", "marginal_likelihood_loss"],
    "dpjax.metrics": ["exact_match", "f1", "squad_em_f1", "has_answer", "open_domain_scores",
                      "passage_scores"],
    "dpjax.config": ["load_config", "load_settings"],
    "dpjax.settings": ["Settings", "Settings.of", "IndexSettings", "DataSettings"],
    "dpjax.main": ["open_searcher", "restore"],
    "dpjax.loading": ["load_searcher", "restore_model"],
    "dpjax.reading": ["best_spans", "evaluate_rc", "read_retrieved"],
    "dpjax.models.bert": ["BertConfig", "BertModel"],
    "dpjax.models.densephrases": ["DensePhrases", "load_exported", "export_dense_phrases"],
    "dpjax.models.reader": ["CrossEncoderReader"],
    "dpjax.data.squad": ["Passage", "Question", "read_squad"],
    "dpjax.data.corpus": ["read_corpus"],
    "dpjax.data.tokenization": ["Tokenizer"],
    "dpjax.index.dump_reader": ["Dump"],
    "dpjax.index.phrase_index": ["PhraseIndex", "PhraseIndex.search", "PhraseIndex.with_options"],
    "dpjax.index.search": ["PhraseSearcher", "PhraseSearcher.search",
                           "PhraseSearcher.search_many", "DensePhrases"],
    "dpjax.index.rescoring": ["Rescorer", "Rescorer.rescore"],
    "dpjax.index.hybrid": ["Hybrid", "Hybrid.recorded", "Hybrid.of", "fuse"],
    "dpjax.index.sparse": ["SparseIndex", "build_sparse"],
}

# Public functions, classes and methods of PUBLIC_MODULES without a docstring, so with an empty
# entry in the reference (properties are not counted). The list only shrinks: document one,
# then take it out of here.
UNDOCUMENTED = {
    "dpjax.data.squad.SkipSummary.skip", "dpjax.data.squad.main", "dpjax.data.corpus.main",
    "dpjax.data.windows.windows_worker_setup", "dpjax.data.windows.windows_worker",
}


def page(root: pathlib.Path, module: str) -> pathlib.Path:
  """pdoc's page of `module`: `a/b/c.html` for `a.b.c`."""
  return root / (module.replace(".", "/") + ".html")


def _function(member):
  """The function behind a class member (a method, class or static method, a property's
  getter), or None."""
  member = member.fget if isinstance(member, property) else member
  member = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
  return member if inspect.isfunction(member) else None


def public_names(module: str) -> list[tuple[str, object]]:
  """(`name` or `Class.member`, object) of every public class and function `module` defines,
  and of the public methods and properties those classes define; an alias
  (`DensePhrases = PhraseSearcher`) under its own name."""
  found = []
  for name, obj in vars(importlib.import_module(module)).items():
    if (name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj))
        or obj.__module__ != module):
      continue
    found.append((name, obj))
    if inspect.isclass(obj) and obj.__name__ == name:
      found += [(f"{name}.{attr}", value) for attr, value in vars(obj).items()
                if not attr.startswith("_") and _function(value)]
  return found


def _undocumented(name: str, obj) -> bool:
  """Whether a public name lacks a docstring of its own (an alias has its target's; a
  property's name says what it is)."""
  if isinstance(obj, property):
    return False
  obj = _function(obj) or obj
  if obj.__name__ != name.rpartition(".")[2]:
    return False
  doc = (obj.__doc__ or "").strip()
  # a dataclass without a docstring gets its signature as one: `Passage(id: str, ...)`
  return not doc or inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[pathlib.Path, list]:
  """The reference of PUBLIC_MODULES rendered as docs/api.md's command does, and what pdoc
  warned of while rendering it."""
  out = tmp_path_factory.mktemp("api")
  pdoc.render.configure(docformat="google")
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      pdoc.pdoc(*PUBLIC_MODULES, output_directory=out)
  finally:
    pdoc.render.configure()  # pdoc's settings are global: its defaults back
  pdoc_dir = pathlib.Path(pdoc.__file__).parent
  return out, [w for w in caught if pdoc_dir in pathlib.Path(w.filename).parents]


def test_the_reference_builds_without_warnings(reference):
  root, pdoc_warnings = reference
  assert (root / "index.html").is_file()
  assert not pdoc_warnings, "\n".join(str(w.message) for w in pdoc_warnings)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_module_has_its_page(reference, module):
  html = page(reference[0], module).read_text(encoding="utf-8")
  assert f"<title>{module} API documentation" in html


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_on_its_page(reference, module):
  html = page(reference[0], module).read_text(encoding="utf-8")
  names = [name for name, _ in public_names(module)]
  assert set(KEY_NAMES.get(module, [])) <= set(names), "a key name is no longer in the module"
  missing = [name for name in names if f'id="{name}"' not in html]
  assert names and not missing, f"{module}'s page lacks {missing}"


def test_public_names_have_docstrings():
  undocumented = {f"{module}.{name}" for module in PUBLIC_MODULES
                  for name, obj in public_names(module) if _undocumented(name, obj)}
  assert not undocumented - UNDOCUMENTED, "no docstring, so an empty entry in the reference"
  assert not UNDOCUMENTED - undocumented, "documented now: take these out of UNDOCUMENTED"


def test_docs_api_command_names_the_same_modules():
  text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
  blocks = re.findall(r"^```bash\s*\n(.*?)^```", text, re.M | re.S)
  command = next(shlex.split(block.replace("\\\n", " ")) for block in blocks
                 if "-m pdoc" in block)
  assert command[1:3] == ["-m", "pdoc"] and "--docformat" in command
  assert command[command.index("--docformat") + 1] == "google"  # as the fixture renders
  assert [word for word in command if word.startswith("dpjax")] == PUBLIC_MODULES
