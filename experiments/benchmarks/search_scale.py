"""How dpjax search cost grows with the index: 1M, 4M, 16M token vectors (Flat, IVF-SQ4, OPQ-PQ).

  python experiments/benchmarks/search_scale.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu-unified --out results/search_scale.json

The vectors are the real ones of the workdir's dump (SQuAD-open small), tiled beyond its size
with small Gaussian noise (sigma = `--noise` x the per-dimension standard deviation) so that
copies are not exact duplicates. Search is dpjax's whole phrase search with question encoding
(`PhraseSearcher.search`, top-10 phrases: start and end token searches, then exact rescoring of
partners); a tiled token t is rescored with the stored vector of token t mod T (same cost).
For each size and index: build time, bytes per token, questions/s and p50/p99 latency at batch 1
and batch 64, and recall@10 of the start-token search against exact inner-product search
(computed by chunked brute force, so no Flat index is needed where Flat does not fit in memory).
Indexes whose estimated memory exceeds `--max-gb` are skipped and reported as such. Writes the
JSON, a Markdown report (tables, extrapolation to English Wikipedia, the dump's encoding
throughput) and a log-log figure beside it.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

WIKIPEDIA_TOKENS = {"before filtering": 3.0e9, "after filtering": 0.8e9}
EXACT_CHUNK = 1 << 18  # vectors per brute-force chunk (recall's exact top-10)


class TiledVectors:
  """N token vectors: the dump's T vectors, then noisy copies of them."""

  def __init__(self, base: np.ndarray, size: int, noise: float, seed: int = 0):
    self.base, self.size, self.seed = base, size, seed
    self.sigma = noise * base[:100_000].astype(np.float32).std(0)

  def __call__(self, lo: int, hi: int) -> np.ndarray:
    rows = np.arange(lo, hi)
    out = self.base[rows % len(self.base)].astype(np.float32)
    tile = rows // len(self.base)
    noisy = tile > 0
    if noisy.any():  # deterministic per chunk start
      rng = np.random.default_rng([self.seed, lo])
      out[noisy] += rng.standard_normal((int(noisy.sum()), out.shape[1]), np.float32) * self.sigma
    return out


def estimated_bytes(spec: str, size: int, dim: int) -> float:
  """Memory an index of `size` vectors needs while it is built (codes + ids + float32 chunk)."""
  if spec == "Flat":
    per = 4 * dim
  elif m := re.search(r"PQ(\d+)x(\d+)", spec):
    per = int(m.group(1)) * int(m.group(2)) / 8
  elif m := re.search(r"SQ(\d+)", spec):
    per = dim * int(m.group(1)) / 8
  else:
    per = 4 * dim
  # Beside the index: float32 chunks of tiled vectors with their noise, the brute-force scores
  # and their argpartition (~6 chunk-sized temporaries at once).
  return size * (per + 8) + 6 * min(size, EXACT_CHUNK) * dim * 4


def estimated_build_seconds(spec: str, size: int, train_size: int,
                            built: list[dict]) -> float | None:
  """Build time of `spec` at `size`, scaled from the largest smaller size built: training costs
  at most nlist x its (fixed) sample, adding costs tokens x nlist (each vector is compared with
  every IVF centroid)."""
  from dpjax.index.faiss_index import resolve_spec
  done = [r for r in built if r["spec"] == spec and "build_seconds" in r and r["size"] < size]
  if not done:
    return None
  last = max(done, key=lambda r: r["size"])

  def nlist(n: int) -> int:
    match = re.search(r"IVF(\d+)", resolve_spec(spec, n, train_size)[0])
    return int(match.group(1)) if match else 1

  train = last.get("train_seconds", 0.0)
  add = last["build_seconds"] - train
  return (train * nlist(size) / nlist(last["size"])
          + add * size * nlist(size) / (last["size"] * nlist(last["size"])))


def available_gb() -> float:
  with open("/proc/meminfo") as f:
    info = dict(line.split(":", 1) for line in f)
  return int(info["MemAvailable"].split()[0]) / 2 ** 20


def build(spec: str, vectors: TiledVectors, dim: int, train_size: int, seed: int = 0):
  import faiss

  from dpjax.index.faiss_index import resolve_spec
  resolved, notes = resolve_spec(spec, vectors.size, train_size)
  start = time.perf_counter()
  index = faiss.index_factory(dim, "IDMap,Flat" if resolved == "Flat" else resolved,
                              faiss.METRIC_INNER_PRODUCT)
  if not index.is_trained:
    rows = np.sort(np.random.default_rng(seed).choice(vectors.size, size=min(
        train_size, vectors.size), replace=False))
    index.train(_gather(vectors, rows))
  trained = time.perf_counter()
  for lo in range(0, vectors.size, 1 << 18):
    hi = min(lo + (1 << 18), vectors.size)
    index.add_with_ids(vectors(lo, hi), np.arange(lo, hi, dtype=np.int64))
  return index, resolved, notes, time.perf_counter() - start, trained - start


def _gather(vectors: TiledVectors, rows: np.ndarray) -> np.ndarray:
  out = []
  for lo in range(0, vectors.size, 1 << 20):
    mine = rows[(rows >= lo) & (rows < lo + (1 << 20))]
    if len(mine):
      out.append(vectors(lo, min(lo + (1 << 20), vectors.size))[mine - lo])
  return np.concatenate(out)


def exact_top(vectors: TiledVectors, queries: np.ndarray, k: int) -> np.ndarray:
  """Exact top-k ids by inner product, chunked over the vectors."""
  best_scores = np.full((len(queries), k), -np.inf, np.float32)
  best_ids = np.zeros((len(queries), k), np.int64)
  for lo in range(0, vectors.size, EXACT_CHUNK):  # ~1.5 GiB of temporaries per chunk
    hi = min(lo + EXACT_CHUNK, vectors.size)
    scores = queries @ vectors(lo, hi).T
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    cand_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, 1)], 1)
    cand_ids = np.concatenate([best_ids, top + lo], 1)
    order = np.argsort(-cand_scores, axis=1)[:, :k]
    best_scores = np.take_along_axis(cand_scores, order, 1)
    best_ids = np.take_along_axis(cand_ids, order, 1)
  return best_ids


def timed_search(searcher, questions: list[str], batch: int, repeats: int) -> dict:
  """Questions/s and p50 / p99 latency of `searcher.search` (top-10 phrases) over `repeats`
  batches (`timing.time_searches`)."""
  from timing import time_searches
  t = time_searches({"searcher": searcher}, questions, batch, repeats, k=10,
                    unit="phrase")["searcher"]
  return {"batch": batch, "questions_per_sec": t["questions_per_s"], "p50_ms": t["p50_ms"],
          "p99_ms": t["p99_ms"], "batches": t["batches"]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--sizes", nargs="+", type=int, default=[1_000_000, 4_000_000, 16_000_000])
  parser.add_argument("--specs", nargs="+", default=["Flat", "IVFauto,SQ4", "OPQ96,IVFauto,PQ96x8"])
  parser.add_argument("--questions", type=int, default=640, help="dev questions timed")
  parser.add_argument("--recall-queries", type=int, default=200)
  parser.add_argument("--noise", type=float, default=0.05)
  parser.add_argument("--max-gb", type=float, default=0.0,
                      help="skip indexes needing more (default: 80%% of available memory)")
  parser.add_argument("--max-build-minutes", type=float, default=0.0,
                      help="skip builds estimated (from the previous size) to take longer "
                      "(default: no limit)")
  parser.add_argument("--out", required=True)
  parser.add_argument("--merge", nargs="*", metavar="TABLE", default=None,
                      help="keep the rows of earlier runs that this run does not measure (e.g. "
                      "add one size or index to a finished table): those in --out, or in the "
                      "TABLEs given (e.g. the tables of two runs on two cores, combined)")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph under the tables (kept by --merge unless given again)")
  args = parser.parse_args(argv)
  from experiments.report import command_line, elide_notes
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  earlier = {"rows": [], "commands": []}
  if args.merge is not None:
    tables = [pathlib.Path(t) for t in args.merge] or [pathlib.Path(args.out)]
    missing = [str(t) for t in args.merge if not pathlib.Path(t).is_file()]
    if missing:
      raise SystemExit(f"--merge: no such table: {', '.join(missing)}")
    earlier = _earlier_tables([t for t in tables if t.is_file()], args)
  from dpjax.config import setup_logging
  setup_logging("dpjax.checkpoint", fmt="%(asctime)s %(message)s")

  import faiss

  from experiments.report import save_results
  from dpjax.data import Tokenizer
  from dpjax.main import open_workdir, restore
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.index.rescoring import Rescorer
  from dpjax.index.search import PhraseSearcher

  config, workdir, dump, questions = open_workdir(args.config, args.workdir, args.set)
  model, step = restore(config, workdir)
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  questions = [q.question for q in questions][:args.questions]
  dim = dump.vectors.shape[1]

  def save(rows: list[dict]) -> None:
    """Writes the table so far (after every row: a killed run keeps what it measured)."""
    measured = {(r["size"], r["spec"]) for r in rows if "skipped" not in r}
    kept = [r for r in earlier["rows"] if (r["size"], r["spec"]) not in measured]
    kept_keys = {(r["size"], r["spec"]) for r in kept}
    rows = [r for r in rows if "skipped" not in r or (r["size"], r["spec"]) not in kept_keys]
    rows += kept
    rank = {spec: i for i, spec in enumerate(dict.fromkeys(
        [*args.specs, *(r["spec"] for r in rows)]))}
    rows.sort(key=lambda r: (r["size"], rank[r["spec"]]))
    manifest = dump.manifest
    results = {"commands": list(dict.fromkeys(earlier.get("commands", []) + [command])),
               "workdir": str(workdir), "model_step": step, "dump_tokens": len(dump.vectors),
               "noise": args.noise, "nprobe": config.index.nprobe, "rows": rows,
               "dump_encoding": {"tokens": manifest["num_tokens"],
                                 "seconds": manifest.get("seconds"),
                                 "tokens_per_sec": manifest["num_tokens"] / manifest["seconds"]
                                 if manifest.get("seconds") else None},
               "extrapolation": extrapolate(rows),
               "notes": args.note or earlier.get("notes", [])}
    out = save_results(args.out, results, report, "experiments/benchmarks/search_scale.py", argv)
    figure(results, out.with_suffix(".png"))

  done = {(r["size"], r["spec"]) for r in earlier["rows"] if "skipped" not in r}
  command = command_line("experiments/benchmarks/search_scale.py", argv)
  rows = []
  for size in args.sizes:
    vectors = TiledVectors(dump.vectors, size, args.noise)
    queries = None
    exact = None
    for spec in args.specs:
      if (size, spec) in done:
        logging.info("%s at %d: measured by an earlier run (--merge), kept", spec, size)
        continue
      need = estimated_bytes(spec, size, dim) / 2 ** 30
      row = {"size": size, "spec": spec, "estimated_gb": need}
      max_gb = args.max_gb or 0.8 * available_gb()  # other processes may have grown
      if need > max_gb:
        row["skipped"] = f"needs ~{need:.1f} GiB, more than the {max_gb:.1f} GiB allowed"
        logging.info("%s at %d: skipped (%s)", spec, size, row["skipped"])
        rows.append(row)
        save(rows)
        continue
      estimate = estimated_build_seconds(spec, size, config.index.train_size,
                                         rows + earlier["rows"])
      if args.max_build_minutes and estimate and estimate > 60 * args.max_build_minutes:
        row["skipped"] = (f"build estimated at ~{estimate / 60:.0f} min (scaled from the smaller "
                          f"size's build), more than the {args.max_build_minutes:g} min allowed")
        logging.info("%s at %d: skipped (%s)", spec, size, row["skipped"])
        rows.append(row)
        save(rows)
        continue
      index, resolved, notes, seconds, train_seconds = build(spec, vectors, dim,
                                                             config.index.train_size)
      if "IVF" in resolved:
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", config.index.nprobe)
      with tempfile.TemporaryDirectory() as tmp:
        faiss.write_index(index, os.path.join(tmp, "index.faiss"))
        index_bytes = os.path.getsize(os.path.join(tmp, "index.faiss"))
      phrase_index = PhraseIndex.over_passages(dump, [0])  # the dump's tables; index swapped:
      phrase_index.index = _ModuloLabels(index, len(dump.vectors))
      phrase_index.num_vectors = size
      phrase_index.kept_mask = None
      phrase_index.rescorer = Rescorer(dump.vectors, dump.token_passage, len(dump.passages))
      searcher = PhraseSearcher(model, phrase_index, tokenizer,
                              max_query_length=config.data.max_query_length, batch_size=64,
                              check_model=False)
      if queries is None:
        queries = searcher.encode(questions[:args.recall_queries])[0]
        exact = exact_top(vectors, queries, 10)
      _, found = index.search(np.ascontiguousarray(queries), 10)
      recall = float(np.mean([len(set(f) & set(e)) / 10 for f, e in zip(found, exact)]))
      searcher.search(questions[:64], k=10, unit="phrase")  # compile / warm up
      row.update(resolved=resolved, notes=notes, build_seconds=seconds,
                 train_seconds=train_seconds, threads=faiss.omp_get_max_threads(),
                 bytes_per_token=index_bytes / size, recall_at_10=recall,
                 batch1=timed_search(searcher, questions, 1, min(200, len(questions))),
                 batch64=timed_search(searcher, questions, 64, max(1, len(questions) // 64)))
      logging.info("%s at %d: build %.0f s, %.1f B/token, recall@10 %.3f, %.1f q/s (batch 64)",
                   spec, size, seconds, row["bytes_per_token"], recall,
                   row["batch64"]["questions_per_sec"])
      rows.append(row)
      save(rows)
      del index, phrase_index, searcher
  save(rows)
  return 0


def _earlier_tables(paths: list[pathlib.Path], args) -> dict:
  """The rows, commands and notes of the earlier tables at `paths`, combined for --merge. A row
  measured in one table replaces a skipped one of another; the same row measured in two tables is
  refused (which one to keep would be a guess). Notes: those of the first table that has any."""
  combined = {"rows": [], "commands": []}
  where = {}
  for path in paths:
    table = _earlier_table(path, args)
    for row in table["rows"]:
      key = (row["size"], row["spec"])
      if key in where:
        first, earlier_row = where[key]
        if "skipped" not in row and "skipped" not in earlier_row:
          raise SystemExit(f"--merge: {row['spec']} at {row['size']:,} tokens is measured in "
                           f"both {first} and {path}; merge one of them")
        if "skipped" in row:
          continue
        combined["rows"].remove(earlier_row)
      where[key] = (path, row)
      combined["rows"].append(row)
    combined["commands"] = list(dict.fromkeys(combined["commands"] + table["commands"]))
    if table.get("notes") and not combined.get("notes"):
      combined["notes"] = table["notes"]
  return combined


def _earlier_table(path: pathlib.Path, args) -> dict:
  """The results an earlier run wrote to `path`, for --merge; refuses a table of another setup."""
  import json
  try:
    earlier = json.loads(path.read_text())
    rows, commands = earlier["rows"], earlier["commands"]
  except (ValueError, KeyError, TypeError) as e:
    raise SystemExit(f"{path}: not a search_scale table that --merge can extend "
                     f"({type(e).__name__}: {e}); move it away or drop --merge")
  same_workdir = (pathlib.Path(earlier.get("workdir", "")).resolve()
                  == pathlib.Path(args.workdir).resolve())
  if not same_workdir or earlier.get("noise") != args.noise:
    raise SystemExit(f"{path} was measured on {earlier.get('workdir')!r} with noise "
                     f"{earlier.get('noise')}, not {args.workdir!r} with noise {args.noise}: "
                     "--merge would mix two setups in one table")
  return {**earlier, "rows": rows, "commands": commands}


class _ModuloLabels:
  """A faiss index whose labels (tiled token ids) map back to the dump's tokens for rescoring."""

  def __init__(self, index, num_tokens: int):
    self.index, self.num_tokens = index, num_tokens

  def search(self, queries, k):
    scores, labels = self.index.search(queries, k)
    return scores, np.where(labels >= 0, labels % self.num_tokens, -1)


def extrapolate(rows: list[dict]) -> dict:
  """Memory (bytes/token x tokens) and questions/s (power law fitted on the measured sizes; none
  when only one size was measured: one point fixes no exponent)."""
  out = {}
  for spec in dict.fromkeys(r["spec"] for r in rows):
    done = [r for r in rows if r["spec"] == spec and "skipped" not in r]
    if not done:
      continue
    sizes = np.array([r["size"] for r in done], float)
    qps = np.array([r["batch64"]["questions_per_sec"] for r in done])
    slope = float(np.polyfit(np.log(sizes), np.log(qps), 1)[0]) if len(done) > 1 else None
    per_token = float(np.mean([r["bytes_per_token"] for r in done]))
    out[spec] = {name: {"tokens": tokens, "memory_gb": per_token * tokens / 2 ** 30,
                        "questions_per_sec": None if slope is None else
                        float(qps[-1] * (tokens / sizes[-1]) ** slope)}
                 for name, tokens in WIKIPEDIA_TOKENS.items()}
    out[spec]["fitted_exponent"] = slope
  return out


def _g(value, spec: str = ".3g") -> str:
  return "n/a (one size measured)" if value is None else format(value, spec)


def report(results: dict, command: str) -> str:
  commands = results.get("commands") or [command]
  lines = ["# Search cost vs index size", "",
           "Command" + ("s (later ones add rows with `--merge`): " if len(commands) > 1 else ": ")
           + "; ".join(f"`{c}`" for c in commands), "",
           f"Real vectors of a {results['dump_tokens']:,}-token dump, tiled with noise "
           f"({results['noise']} x std) beyond it; nprobe {results['nprobe']}; whole dpjax "
           "phrase search including question encoding; this machine's CPU.", "",
           "| tokens | index | build s | bytes/token | recall@10 | q/s batch 1 | p50 / p99 ms "
           "(batch 1) | q/s batch 64 | p50 / p99 ms (batch 64) |", "|---|---|---|---|---|---|---|---|---|"]
  for r in results["rows"]:
    if "skipped" in r:
      lines.append(f"| {r['size']:,} | {r['spec']} | skipped: {r['skipped']} | | | | | | |")
      continue
    b1, b64 = r["batch1"], r["batch64"]
    lines.append(f"| {r['size']:,} | {r['resolved']} | {r['build_seconds']:.0f} | "
                 f"{r['bytes_per_token']:.1f} | {r['recall_at_10']:.3f} | "
                 f"{b1['questions_per_sec']:.1f} | {b1['p50_ms']:.0f} / {b1['p99_ms']:.0f} | "
                 f"{b64['questions_per_sec']:.1f} | {b64['p50_ms']:.0f} / {b64['p99_ms']:.0f} |")
  enc = results["dump_encoding"]
  if enc["tokens_per_sec"]:
    lines += ["", f"Dump encoding throughput: {enc['tokens_per_sec']:,.0f} tokens/s "
              f"({enc['tokens']:,} tokens in {enc['seconds']:.0f} s)."]
  lines += ["", "## On paper: English Wikipedia", "",
            "Memory = bytes/token x tokens; questions/s extrapolated with the power law fitted "
            "on the measured sizes (not measured).", "",
            "| index | tokens | memory GiB | q/s (batch 64, extrapolated) | fitted exponent |",
            "|---|---|---|---|---|"]
  for spec, e in results["extrapolation"].items():
    for name in WIKIPEDIA_TOKENS:
      lines.append(f"| {spec} | {e[name]['tokens']:.1e} ({name}) | {e[name]['memory_gb']:,.0f} | "
                   f"{_g(e[name]['questions_per_sec'])} | {_g(e['fitted_exponent'], '.2f')} |")
  from experiments.report import with_notes
  return with_notes(lines, results.get("notes", []))


def figure(results: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for spec in dict.fromkeys(r["spec"] for r in results["rows"]):
    done = [r for r in results["rows"] if r["spec"] == spec and "skipped" not in r]
    if done:
      line, = ax.plot([r["size"] for r in done], [r["batch64"]["questions_per_sec"] for r in done],
                      marker="o", label=f"{spec} (batch 64)")
      ax.plot([r["size"] for r in done], [r["batch1"]["questions_per_sec"] for r in done],
              marker="x", linestyle="--", color=line.get_color(), label=f"{spec} (batch 1)")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("index size (token vectors)")
  ax.set_ylabel("questions / s")
  ax.grid(alpha=0.3, which="both")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  sys.exit(main())
