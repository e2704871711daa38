"""`run.py index`: the configured faiss indexes over the dump (with `index.sparse`, its BM25)."""
from __future__ import annotations

import pathlib

from dpjax.index.hybrid_weights import build_sparse_index
from dpjax.index.faiss_index import build_index
from dpjax.workdir import Workdir
from dpjax.loading import checked_dump, writes_to


@writes_to
def run(config, workdir: Workdir) -> list[pathlib.Path]:
  """`run.py index`: the configured faiss indexes (`index.specs`) over the dump, and with
  `index.sparse` its BM25 index and hybrid weight (`dpjax.index.hybrid_weights`)."""
  dump = workdir.dump(config.index.dump_name)
  checked_dump(config, workdir)
  built = [build_index(dump, spec, filter_threshold=config.index.filter_threshold,
                       train_size=config.index.train_size, nprobe=config.index.nprobe)
           for spec in config.index.specs]
  if config.index.sparse:  # after the faiss indexes: choosing its weight searches one
    built.append(build_sparse_index(config, workdir))
  return built
