"""A complete dump loaded into memory (`Dump`), its manifest and shards checked first."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np

from dpjax.data.squad import Passage
from dpjax.errors import DumpError
from dpjax.index.manifest import read_manifest
from dpjax.index.shards import check_shards

TOKEN_ARRAYS = ("vectors", "filter_logits", "token_passage", "char_spans")


@dataclasses.dataclass
class Dump:
  """A complete dump loaded into memory (vectors kept float16)."""

  directory: pathlib.Path
  manifest: dict
  vectors: np.ndarray  # [T, D] float16
  filter_logits: np.ndarray  # [T, 2] float16
  token_passage: np.ndarray  # [T] int32, global passage row
  char_spans: np.ndarray  # [T, 2] int32
  passages: list[Passage]

  @classmethod
  def load(cls, directory: str | os.PathLike, *, verify: bool = False,
           tokens: bool = True) -> "Dump":
    """The dump in `directory`; its shards' file sizes checked against those recorded, and with
    `verify` their contents (`check_shards`). Without `tokens`, its passages only: the token
    arrays are empty (a compact index carries its own; the dump's need not be there)."""
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    check_shards(directory, manifest, contents=verify,
                 names=None if tokens else ["passages.jsonl"])
    keys = TOKEN_ARRAYS if tokens else ()
    arrays = {k: [] for k in keys}
    passages, offset = [], 0
    for shard in manifest["shards"]:
      path = directory / shard["name"]
      try:
        for key in keys:
          value = np.load(path / f"{key}.npy")
          arrays[key].append(value + offset if key == "token_passage" else value)
        passages.extend(_shard_passages(path))
      except (OSError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: shard is missing or damaged ({type(e).__name__}: {e}); "
                        "delete the dump and run it again") from None
      offset = len(passages)
    joined = ({k: np.concatenate(v) for k, v in arrays.items()} if tokens
              else _no_tokens(manifest["dim"]))
    if (tokens and len(joined["vectors"]) != manifest["num_tokens"]) or len(
        passages) != manifest["num_passages"]:
      raise DumpError(f"{directory}: shard contents do not match the manifest counts")
    return cls(directory, manifest, passages=passages, **joined)

  @staticmethod
  def read_passages(directory: str | os.PathLike) -> list[Passage]:
    """The dump's passages in row order without its vectors (for what needs only the texts)."""
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    passages = []
    for shard in manifest["shards"]:
      try:
        passages.extend(_shard_passages(directory / shard["name"]))
      except (OSError, ValueError, TypeError) as e:
        raise DumpError(f"{directory / shard['name']}: passages missing or damaged "
                        f"({type(e).__name__}: {e}); delete the dump and run it again") from None
    if len(passages) != manifest["num_passages"]:
      raise DumpError(f"{directory}: {len(passages)} passages in the shards, "
                      f"{manifest['num_passages']} in the manifest")
    return passages


def _no_tokens(dim: int) -> dict[str, np.ndarray]:
  """Empty token arrays of a dump loaded without them (`Dump.load(tokens=False)`)."""
  return {"vectors": np.zeros((0, dim), np.float16),
          "filter_logits": np.zeros((0, 2), np.float16),
          "token_passage": np.zeros(0, np.int32), "char_spans": np.zeros((0, 2), np.int32)}


def _shard_passages(path: pathlib.Path) -> list[Passage]:
  with (path / "passages.jsonl").open(encoding="utf-8") as f:
    return [Passage(**json.loads(line)) for line in f]
