"""dpjax: dense phrase retrieval (DensePhrases) in JAX/Flax.

`dpjax.PhraseSearcher(model, dpjax.PhraseIndex(dump_dir, "Flat")).search("question", k=10,
unit="passage")` answers questions over an indexed corpus (see README).
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import dpjax` does not start JAX
  if name in ("PhraseSearcher", "DensePhrases", "PhraseIndex"):
    from dpjax.index import search  # the package's one lazy import (tests/test_layers.py)
    return getattr(search, name)
  raise AttributeError(f"module 'dpjax' has no attribute {name!r}")
