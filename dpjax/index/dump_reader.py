"""A complete dump loaded into memory (`Dump`), its manifest and shards checked first."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Sequence

import numpy as np

from dpjax.data.squad import Passage
from dpjax.errors import DumpError
from dpjax.index.manifest import kept_settings, read_manifest
from dpjax.index.shards import check_shards, shard_context_offsets, shard_token_layout

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
  passages: Sequence[Passage]  # a list, or a compact index's `PassageStore`
  # [T] int64 each token's id among the encoded tokens, where a dump-time filter kept only some
  # (`dump_codes`): a phrase spans max_answer_length of those at most (None: every one kept)
  positions: np.ndarray | None = None

  @classmethod
  def load(cls, directory: str | os.PathLike, *, verify: bool = False, tokens: bool = True,
           passages: bool = True) -> "Dump":
    """The dump in `directory`; its shards' file sizes checked against those recorded, and with
    `verify` their contents (`check_shards`). Without `tokens`, the token arrays are empty, and
    without `passages` the passages (a compact index carries its own of both; the dump's need
    not be there)."""
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    if tokens:
      require_vectors(manifest, directory)
    check_shards(directory, manifest, contents=verify,
                 names=None if tokens else ["passages.jsonl"] if passages else [])
    keys = TOKEN_ARRAYS if tokens else ()
    filtered = kept_settings(manifest["settings"])["filter_threshold"] is not None
    arrays = {k: [] for k in keys + (("positions",) if tokens and filtered else ())}
    rows, offset = [], 0
    for shard, context in zip(manifest["shards"], shard_context_offsets(manifest)):
      path = directory / shard["name"]
      try:
        if tokens:
          token_passage, ids, _ = shard_token_layout(path, shard)
          if filtered:
            arrays["positions"].append(ids + context)
        for key in keys:
          value = token_passage if key == "token_passage" else np.load(path / f"{key}.npy")
          arrays[key].append(value + offset if key == "token_passage" else value)
        if passages:
          rows.extend(shard_passages(path))
      except (OSError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: shard is missing or damaged ({type(e).__name__}: {e}); "
                        "delete the dump and run it again") from None
      offset = len(rows) if passages else offset + shard["passages"]
    joined = ({k: np.concatenate(v) for k, v in arrays.items()} if tokens
              else _no_tokens(manifest["dim"]))
    if tokens:  # (uint16 in a shard of kept tokens)
      joined["char_spans"] = joined["char_spans"].astype(np.int32, copy=False)
    if (tokens and len(joined["vectors"]) != manifest["num_tokens"]) or (
        passages and len(rows) != manifest["num_passages"]):
      raise DumpError(f"{directory}: shard contents do not match the manifest counts")
    return cls(directory, manifest, passages=rows, **joined)

  @staticmethod
  def read_passages(directory: str | os.PathLike) -> list[Passage]:
    """The dump's passages in row order without its vectors (for what needs only the texts)."""
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    passages = []
    for shard in manifest["shards"]:
      try:
        passages.extend(shard_passages(directory / shard["name"]))
      except (OSError, ValueError, TypeError) as e:
        raise DumpError(f"{directory / shard['name']}: passages missing or damaged "
                        f"({type(e).__name__}: {e}); delete the dump and run it again") from None
    if len(passages) != manifest["num_passages"]:
      raise DumpError(f"{directory}: {len(passages)} passages in the shards, "
                      f"{manifest['num_passages']} in the manifest")
    return passages


def require_vectors(manifest: dict, directory: pathlib.Path, what: str = "") -> None:
  """Refuses (one DumpError line) a dump made without float16 vectors (`index.dump_vectors`)
  for what needs them (`what`: its name; Flat/IVF indexes, qsft, the filter, subcorpora,
  mining)."""
  if not kept_settings(manifest.get("settings", {}))["vectors"]:
    raise DumpError(f"{directory}: {what or 'this mode'} needs the dump's float16 token "
                    "vectors, and the dump has none (index.dump_vectors=False, its codes only): "
                    "dump again with index.dump_vectors=True into a new index.dump_name, or use "
                    "a compact index")


def _no_tokens(dim: int) -> dict[str, np.ndarray]:
  """Empty token arrays of a dump loaded without them (`Dump.load(tokens=False)`)."""
  return {"vectors": np.zeros((0, dim), np.float16),
          "filter_logits": np.zeros((0, 2), np.float16),
          "token_passage": np.zeros(0, np.int32), "char_spans": np.zeros((0, 2), np.int32)}


def shard_passages(path: pathlib.Path) -> list[Passage]:
  """The passages of the shard in folder `path`, in row order (its `passages.jsonl`)."""
  with (path / "passages.jsonl").open(encoding="utf-8") as f:
    return [Passage(**json.loads(line)) for line in f]
