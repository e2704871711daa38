"""`run.py index`: the configured faiss indexes over the dump (with `index.sparse`, its BM25)."""
from __future__ import annotations

import pathlib

from dpjax.index.hybrid_weights import build_sparse_index
from dpjax.index.faiss_index import build_index
from dpjax.workdir import Workdir
from dpjax.loading import checked_dump
from dpjax.main import writes_to
from dpjax.settings import Settings


@writes_to
def run(settings: Settings, workdir: Workdir) -> list[pathlib.Path]:
  """`run.py index`: the configured faiss indexes (`index.specs`) over the dump, and with
  `index.sparse` its BM25 index and hybrid weight (`dpjax.index.hybrid_weights`)."""
  index = settings.index
  dump = workdir.dump(index.dump_name)
  checked_dump(settings.data, index, workdir)
  built = [build_index(dump, spec, filter_threshold=index.filter_threshold,
                       train_size=index.train_size, nprobe=index.nprobe)
           for spec in index.specs]
  if index.sparse:  # after the faiss indexes: choosing its weight searches one
    built.append(build_sparse_index(settings.model, settings.data, settings.eval, index,
                                    workdir, best_metric=settings.validation.metric))
  return built
