"""`run.py search`: `--query` questions answered over the workdir's index, the top units printed.
"""
from __future__ import annotations

from typing import Sequence

from dpjax.errors import ConfigError
from dpjax.main import open_searcher
from dpjax.settings import Settings


def run(settings: Settings, workdir: str, queries: Sequence[str]) -> list:
  """`run.py search`: answers questions and prints the top units."""
  if not queries or not all(q.strip() for q in queries):
    raise ConfigError("search needs one or more non-empty --query \"question\"")
  searcher, _ = open_searcher(settings, workdir, verify=settings.index.verify)
  results = searcher.search(list(queries), k=settings.index.top_k, unit=settings.index.unit,
                            max_answer_length=settings.eval.max_answer_length)
  for query, found in zip(queries, results):
    print(f"Q: {query}")
    for rank, r in enumerate(found, 1):
      print(f"  {rank}. {r['answer']!r} ({r['score']:.2f}) — {r['title']}: "
            f"{r.get('sentence', r['passage'])[:120]}")
  return results
