"""Compact indexes (`compact:<codec>`) of a workdir's dump: bytes per dump token by part, answer
agreement with the Flat index and search speed, per codec.

  python experiments/benchmarks/compact_codes.py --config experiments/demo.py \\
      --workdir workdirs/demo --scratch /tmp/compact_codes --out results/compact_codes.json

The dump is copied into --scratch (the workdir is only read); each codec's compact index is
built into the copy, then searched from a second copy that holds no shard token array (no
vectors, filter logits, token passages or spans: the compact index's own parts only). The
evaluation questions are encoded once; the Flat index and each compact index answer them with
the same vectors (top-10 phrases): EM@1 / EM@10, the share of questions whose top-1 answer text
(and passage) is the Flat index's, and questions per second of `PhraseIndex.search`.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shlex
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from experiments.report import git_commit  # noqa: E402

CODECS = ["SQfp16", "SQ4", "PQ48", "PQ32", "PQ16", "OPQ32,PQ32"]
TOKEN_FILES = ("vectors.npy", "filter_logits.npy", "token_passage.npy", "char_spans.npy")


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--scratch", required=True, help="the dump's copies go here")
  parser.add_argument("--codecs", nargs="+", default=CODECS)
  parser.add_argument("--filter-threshold", type=float, default=None,
                      help="also each codec over the tokens this filter threshold keeps")
  parser.add_argument("--out", required=True)
  parser.add_argument("--set", action="append", default=[])
  return parser.parse_args(argv)


def copies(dump: pathlib.Path, scratch: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """(a full copy of the dump, with its Flat index; a copy of that without token arrays)."""
  full, bare = scratch / "dump", scratch / "dump_without_token_arrays"
  for path in (full, bare):
    shutil.rmtree(path, ignore_errors=True)
  shutil.copytree(dump, full, ignore=lambda folder, names: [
      n for n in names if pathlib.Path(folder).name == "indexes" and n != "Flat"])
  return full, bare


def strip_tokens(full: pathlib.Path, bare: pathlib.Path) -> None:
  shutil.rmtree(bare, ignore_errors=True)
  shutil.copytree(full, bare, ignore=lambda folder, names: [
      n for n in names if n in TOKEN_FILES and pathlib.Path(folder).name.startswith("shard_")])


def answers(index, q_start, q_end, max_answer_length: int):
  """(top-10 phrases per question, seconds of the search)."""
  start = time.perf_counter()
  found = index.search(q_start, q_end, 10, max_answer_length=max_answer_length)
  return [[p for p, _ in units] for units in found], time.perf_counter() - start


def row(index, phrases, flat, golds, seconds: float) -> dict:
  """One index's figures against the Flat index's answers."""
  from dpjax import metrics
  texts = [[p.text for p in units] for units in phrases]
  agree = [bool(a) and bool(b) and a[0].text == b[0].text for a, b in zip(phrases, flat)]
  same_passage = [bool(a) and bool(b) and a[0].passage == b[0].passage
                  for a, b in zip(phrases, flat)]
  manifest = index.manifest
  return {**metrics.open_domain_scores(texts, golds),
          "top1_answer_agrees_with_flat": 100 * float(np.mean(agree)),
          "top1_passage_agrees_with_flat": 100 * float(np.mean(same_passage)),
          "questions_per_sec": len(phrases) / seconds, "kept_tokens": manifest["num_tokens"],
          "code_bytes": manifest.get("code_size"), "build_seconds": manifest["build_seconds"],
          "bytes_per_dump_token": manifest.get("bytes_per_token"),
          "parts_per_dump_token": {k: v["per_token"] for k, v in manifest.get("parts", {}).items()}}


def dump_parts(dump) -> dict:
  """Bytes per dump token of each shard file kind (what a Flat search reads beside its index)."""
  sizes: dict = {}
  for shard in dump.manifest["shards"]:
    for name, record in shard.get("files", {}).items():
      sizes[name] = sizes.get(name, 0) + record["bytes"]
  return {name: size / dump.manifest["num_tokens"] for name, size in sorted(sizes.items())}


def main(argv=None) -> int:
  args = parse(argv)
  from dpjax.index.faiss_index import build_index, index_folder
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.index.search import PhraseSearcher
  from dpjax.main import open_workdir, restore

  config, workdir, dump, questions = open_workdir(args.config, args.workdir, args.set)
  full, bare = copies(dump.directory, pathlib.Path(args.scratch))
  specs = [(f"compact:{codec}", threshold) for codec in args.codecs
           for threshold in [None] + ([args.filter_threshold] if args.filter_threshold is not None
                                      else [])]
  for spec, threshold in specs:
    build_index(full, spec, filter_threshold=threshold, train_size=config.index.train_size)
  strip_tokens(full, bare)
  model, step = restore(config, workdir)
  flat = PhraseIndex(full, "Flat")
  q_start, q_end = PhraseSearcher(model, flat).encode([q.question for q in questions])
  golds, length = [q.answers for q in questions], config.eval.max_answer_length
  flat_phrases, seconds = answers(flat, q_start, q_end, length)
  rows = {"Flat": {**row(flat, flat_phrases, flat_phrases, golds, seconds),
                   "bytes_per_dump_token": flat.manifest["index_bytes"] / len(dump.vectors)}}
  for spec, threshold in specs:
    name = index_folder(spec, threshold)
    index = PhraseIndex(bare, name, verify=True)
    phrases, seconds = answers(index, q_start, q_end, length)
    rows[name] = {"spec": spec, "filter_threshold": threshold,
                  **row(index, phrases, flat_phrases, golds, seconds)}
  out = {"command": shlex.join(["python", "experiments/benchmarks/compact_codes.py"]
                               + (argv if argv is not None else sys.argv[1:])),
         "commit": git_commit(), "machine": platform.machine(), "processor": platform.processor(),
         "workdir": str(workdir), "model_step": step, "questions": len(questions),
         "dump_tokens": len(dump.vectors), "dim": int(dump.vectors.shape[1]),
         "dump_bytes_per_token": dump_parts(dump), "indexes": rows}
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
  return 0


if __name__ == "__main__":
  sys.exit(main())
