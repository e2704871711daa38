"""`run.py data`: the configured data set written (or found) and its counts printed.
"""
from __future__ import annotations

from dpjax.data import RCSplit, data_files, load_rc_split
from dpjax.data.tokenization import Tokenizer
from dpjax.settings import Settings


def run(settings: Settings, workdir: str) -> dict[str, RCSplit]:
  """`run.py data`: writes/locates the configured files, reads them, and prints the counts."""
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  splits = {}
  for name, path in data_files(settings.data, workdir).items():
    if name == "corpus":
      continue
    split = load_rc_split(path, tokenizer, settings.data)
    answerable = int((split.features.start_position > 0).sum())
    print(f"{name}: {path}: {split.summary.questions_seen} questions read, "
          f"{len(split.questions)} kept, {split.summary.total} records skipped; "
          f"{len(split.passages)} passages, {len(split.features.windows)} windows, "
          f"{len(split.features)} features ({answerable} with the answer in the window)")
    splits[name] = split
  return splits
