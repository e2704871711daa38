"""`run.py search`: `--query` questions answered over the workdir's index, the top units printed.
"""
from __future__ import annotations

from typing import Sequence

from dpjax.errors import ConfigError
from dpjax.loading import load_searcher


def run(config, workdir: str, queries: Sequence[str]) -> list:
  """`run.py search`: answers questions and prints the top units."""
  if not queries or not all(q.strip() for q in queries):
    raise ConfigError("search needs one or more non-empty --query \"question\"")
  searcher, _ = load_searcher(config, workdir, verify=config.index.verify)
  results = searcher.search(list(queries), k=config.index.top_k, unit=config.index.unit,
                            max_answer_length=config.eval.max_answer_length)
  for query, found in zip(queries, results):
    print(f"Q: {query}")
    for rank, r in enumerate(found, 1):
      print(f"  {rank}. {r['answer']!r} ({r['score']:.2f}) — {r['title']}: "
            f"{r.get('sentence', r['passage'])[:120]}")
  return results
