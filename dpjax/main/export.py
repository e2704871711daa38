"""`run.py export`: a trained workdir's encoders as Hugging Face BERT checkpoints.

`out/phrase`, `out/query_start`, `out/query_end` each hold settings.json, model.safetensors and the
tokenizer files, and load as `transformers.BertModel`; `out/filter_head.safetensors` and
`out/densephrases.json` complete the model, which `dpjax.models.load_exported(out)` loads back.
"""
from __future__ import annotations

import pathlib

from dpjax.errors import ConfigError
from dpjax.workdir import Workdir
from dpjax.models.densephrases import EXPORT_INFO, export_dense_phrases
from dpjax.models.pretrained import resolve_model_dir
from dpjax.loading import apply_filter_head
from dpjax.main import restore, writes_to
from dpjax.settings import Settings


@writes_to
def run(settings: Settings, workdir: Workdir, out: str) -> pathlib.Path:
  """Exports the workdir's model (the checkpoint `eval.checkpoint` names) to `out`."""
  if not out:
    raise ConfigError("export needs --out DIR (the folder to write)")
  # The export replaces `out` whole: only an earlier export may be there (not, say, a workdir).
  if pathlib.Path(out).exists() and not (pathlib.Path(out) / EXPORT_INFO).is_file():
    raise ConfigError(f"export --out {out}: exists and is not an earlier export (no "
                      f"{EXPORT_INFO}), and the export would replace all of it; choose a new "
                      "folder")
  model, step = restore(settings, workdir)
  apply_filter_head(model, workdir)
  path = export_dense_phrases(model, out, tokenizer_dir=resolve_model_dir(settings.model.tokenizer),
                              info={"workdir": str(workdir), "step": step,
                                    "checkpoint": settings.eval.checkpoint,
                                    "model": settings.model.name})
  print(f"exported the encoders of {workdir} (step {step}) to {path}/"
        "{phrase,query_start,query_end}")
  return path
