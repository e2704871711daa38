"""`run.py dump`: every passage of the corpus encoded by the workdir's phrase encoder (its dump)."""
from __future__ import annotations

import logging
import pathlib

from dpjax.data import SkipSummary, Tokenizer
from dpjax.data.corpus import read_corpus
from dpjax.index.dump import dump_phrases
from dpjax.index.manifest import dump_config
from dpjax.workdir import Workdir
from dpjax.parallel import make_mesh
from dpjax.loading import apply_filter_head, data_paths
from dpjax.main import restore, writes_to
from dpjax.main.index import question_weighting
from dpjax.settings import Settings

log = logging.getLogger(__name__)


@writes_to
def run(settings: Settings, workdir: Workdir) -> dict:
  """`run.py dump`: every passage of the corpus encoded by the workdir's phrase encoder."""
  # The model first: a workdir without one is refused before the data set is written into it.
  model, step = restore(settings, workdir)
  paths = data_paths(settings.data, settings.index, workdir)
  head = apply_filter_head(model, workdir)  # a separately trained filter, if `run.py filter` ran
  mesh = make_mesh(local=True)  # each process encodes its own shards on its own devices
  summary = SkipSummary()
  try:
    manifest = dump_phrases(model, Tokenizer.from_pretrained(settings.model.tokenizer),
                            read_corpus(paths["corpus"], summary), paths["dump"],
                            dump_config(settings.data, settings.index, settings.model.dtype, mesh),
                            mesh=mesh, workers=settings.index.dump_workers,
                            model_info={"workdir": str(workdir), "step": step,
                                        "name": settings.model.name,
                                        "tokenizer": str(settings.model.tokenizer)},
                            corpus_info={"files": [{"path": str(f), "bytes": _size(f)}
                                                   for f in paths["corpus"]]},
                            filter_head=head,
                            question_weighting=lambda: question_weighting(settings, workdir))
  finally:  # also when the dump fails (e.g. every record skipped: "the corpus is empty")
    if summary.total:
      log.warning("%s", summary)
  encoded = manifest.get("encoded_tokens")
  context = manifest.get("context_tokens", manifest["num_tokens"])
  log.info("dump %s: %d passages, %d tokens%s%s%s", paths["dump"], manifest["num_passages"],
           manifest["num_tokens"],
           f" of {context} (index.dump_filter_threshold)" if context != manifest["num_tokens"]
           else "",
           f", {manifest['bytes_per_token']:.1f} bytes per token on disk"
           if "bytes_per_token" in manifest else "",
           f" (encoded {encoded / max(manifest['num_tokens'], 1):.3f} tokens per stored one: "
           "titles, [CLS]/[SEP] and overlapping windows' contexts)" if encoded else "")
  return manifest


def _size(path) -> int | None:
  return pathlib.Path(path).stat().st_size if pathlib.Path(path).is_file() else None
