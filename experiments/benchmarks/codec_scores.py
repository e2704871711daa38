"""Why codes lose answers: how well each codec keeps the token scores a search ranks by, on the
filter's kept tokens of a workdir's dump and the model's own questions.

  taskset -c 1 python experiments/benchmarks/codec_scores.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu --threshold -2.9140625 \\
      --codecs "OPQ24,PQ24" "PQ24" "qw:OPQ24,PQ24" --out results/codec_scores.json

The kept tokens' vectors X (those the filter keeps at `--threshold`) and `--questions` dev
questions' start and end vectors Q (the first of the file, each a query); for each codec,
trained on a seeded sample of `--sample` kept tokens, X is encoded and decoded to X^ and every
query's top 100 tokens by exact score (Q X^T) are compared with its top 100 by decoded score:
the share of queries whose exact best token is the decoded best (top1_at1) or among the decoded
top 10 / 100, the recall of the exact top 10 in the decoded top 100, and the decoded scores'
error on the exact top 100 tokens (its spread, each query's mean error removed) relative to the
spread of their exact scores (rel_score_err: 1 means the error is as wide as the differences it
must rank). `qw:<codec>` codes the tokens after the question-weighted map x -> C^1/2 x (C the
second moment of `--train-questions` training questions' vectors) and maps queries by C^-1/2,
so that the codec's squared error is the expected squared score error. `pr:<codec>` codes each
token's residual from its passage's mean kept vector, the means kept exact (float32: the bound
of coding them, as IVF codes residuals from its centroids, with a passage a list), and decodes
mean + residual; `qw+pr:<codec>` does both. The dump's energy is described too: the share of the
mean vector in E|x|^2, the token and question spectra, and the share of the tokens' variance
left within their passages; and how often each query's exact best token lies in one of the
top-N passages by the query's score of the passages' mean kept vectors (`passage_recall`: what
a search that scores only the tokens of its best passages by mean would keep). With `--em`,
each codec's dense EM@1 and passage Top-k of the same questions: an exact in-memory index over
its decoded kept tokens (what an exhaustive search of the codes ranks by), rescored from them
(codec `Flat`: the dump's own vectors of the kept tokens). A codec already in `--out` with the
same setup (and, for `--em`, its figures) is kept, not measured again (each row names its
commit).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.report import elide_notes, git_commit, save_results, with_notes  # noqa: E402

TOP = 100
CHUNK = 100  # queries scored against every token at once
ENCODE_ROWS = 1 << 16


def top(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids, scores) [Q, k] of each row's k highest scores, best first."""
  k = min(k, scores.shape[1])
  ids = np.argpartition(-scores, k - 1, axis=1)[:, :k]
  values = np.take_along_axis(scores, ids, 1)
  order = np.argsort(-values, 1, kind="stable")
  return np.take_along_axis(ids, order, 1), np.take_along_axis(values, order, 1)


def exact_top(queries: np.ndarray, tokens: np.ndarray, k: int = TOP):
  """Each query's top-k token ids and scores by exact inner product."""
  found = [top(queries[i:i + CHUNK] @ tokens.T, k) for i in range(0, len(queries), CHUNK)]
  return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


def agreement(queries: np.ndarray, decoded: np.ndarray, exact_ids: np.ndarray,
              exact_scores: np.ndarray, mapped: np.ndarray | None = None) -> dict:
  """How the decoded tokens' ranking keeps the exact one (module docstring); `mapped`: the
  queries as the decoded tokens' space wants them (default `queries`)."""
  mapped = queries if mapped is None else mapped
  k = exact_ids.shape[1]
  hits = {1: 0, 10: 0, k: 0}
  recall, errors = 0.0, []
  for lo in range(0, len(queries), CHUNK):
    rows = slice(lo, lo + CHUNK)
    ids, _ = top(mapped[rows] @ decoded.T, k)
    for found, exact in zip(ids, exact_ids[rows]):
      for n in hits:
        hits[n] += exact[0] in found[:n]
      recall += len(np.intersect1d(exact[:10], found)) / min(10, k)
    approx = np.einsum("qd,qkd->qk", mapped[rows], decoded[exact_ids[rows]])
    error = approx - exact_scores[rows]
    error -= error.mean(1, keepdims=True)
    spread = exact_scores[rows].std(1)
    errors.append(error.std(1) / np.maximum(spread, 1e-12))
  n = len(queries)
  return {"top1_at1": hits[1] / n, "top1_at10": hits[10] / n, f"top1_at{k}": hits[k] / n,
          f"recall10_at{k}": recall / n, "rel_score_err": float(np.mean(np.concatenate(errors)))}


def question_weighting(train_queries: np.ndarray):
  """(token map, query map) of the question-weighted codes: x -> x C^1/2, q -> q C^-1/2 (C the
  queries' second moment, its eigenvalues floored at 1e-6 of the largest)."""
  q = train_queries.astype(np.float64)
  values, vectors = np.linalg.eigh(q.T @ q / len(q))
  values = np.maximum(values, values.max() * 1e-6)
  root = ((vectors * np.sqrt(values)) @ vectors.T).astype(np.float32)
  inverse = ((vectors / np.sqrt(values)) @ vectors.T).astype(np.float32)
  return (lambda x: x @ root), (lambda x: x @ inverse)


def coded(spec: str, sample: np.ndarray, tokens: np.ndarray):
  """(decoded tokens, train seconds, encode seconds, code bytes) of a faiss codec `spec`."""
  import faiss
  codec = faiss.index_factory(tokens.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
  start = time.perf_counter()
  codec.train(np.ascontiguousarray(sample))
  trained = time.perf_counter() - start
  decoded = np.empty_like(tokens)
  start = time.perf_counter()
  for lo in range(0, len(tokens), ENCODE_ROWS):
    part = np.ascontiguousarray(tokens[lo:lo + ENCODE_ROWS])
    decoded[lo:lo + ENCODE_ROWS] = codec.sa_decode(codec.sa_encode(part))
  return decoded, trained, time.perf_counter() - start, int(codec.sa_code_size())


def passage_means(tokens: np.ndarray, passages: np.ndarray) -> np.ndarray:
  """[N, D] each token's passage's mean token (the tokens in passage order, as a dump's)."""
  starts = np.flatnonzero(np.r_[True, passages[1:] != passages[:-1]])
  sums = np.add.reduceat(tokens.astype(np.float64), starts, axis=0)
  counts = np.diff(np.r_[starts, len(tokens)])
  return np.repeat((sums / counts[:, None]).astype(np.float32), counts, axis=0)


def passage_recall(queries: np.ndarray, tokens: np.ndarray, passages: np.ndarray,
                   best: np.ndarray, depths=(1, 10, 100, 200, 1000)) -> dict:
  """{N: share of queries whose best token (`best`, a row of `tokens`) is in one of their top-N
  passages by the query's score of each passage's mean token}."""
  starts = np.flatnonzero(np.r_[True, passages[1:] != passages[:-1]])
  counts = np.diff(np.r_[starts, len(tokens)])
  means = (np.add.reduceat(tokens.astype(np.float64), starts, axis=0)
           / counts[:, None]).astype(np.float32)
  own = np.searchsorted(starts, best, side="right") - 1  # each best token's passage (its row)
  ranks = np.concatenate([
      ((s := queries[lo:lo + CHUNK] @ means.T) > s[np.arange(len(s)), own[lo:lo + CHUNK], None]
       ).sum(1) for lo in range(0, len(queries), CHUNK)])
  return {"passages": int(len(starts)),
          **{str(n): float(np.mean(ranks < n)) for n in depths}}


def to_original(decoded: np.ndarray, train_queries: np.ndarray) -> np.ndarray:
  """Decoded question-weighted tokens mapped back (x C^1/2 -> x): their scores are the
  queries' scores of the decoded tokens (q C^-1/2 . x^ C^1/2 = q . x^ C^-1/2 C^1/2)."""
  _, to_queries = question_weighting(train_queries)
  return to_queries(decoded)  # (C^-1/2 is symmetric: x' C^-1/2 = x)


def search_scores(dump, kept: np.ndarray, queries: np.ndarray, answers, evaluation) -> dict:
  """Dense EM@1 / EM@10 and passage Top-1/5/20 of the questions (`queries`: their start then
  end vectors) over an exact in-memory index of the dump's `kept` tokens."""
  from dpjax.index.evaluate import retrieval_scores
  from dpjax.index.phrase_index import PhraseIndex
  index = PhraseIndex.over_tokens(dump, kept, search_device="faiss")
  n = len(answers)
  report = retrieval_scores(index, queries[:n], queries[n:], answers,
                            max_answer_length=evaluation.max_answer_length, passage_k=20,
                            regex=evaluation.regex)
  return {k: report[k] for k in ("em@1", "em@10", "top1", "top5", "top20")}


def parse_codec(spec: str) -> tuple[set[str], str]:
  """({"qw", "pr"} modifiers, the faiss factory string) of "[qw|pr|qw+pr:]<codec>"."""
  head, _, codec = spec.partition(":")
  mods = set(head.split("+")) if codec else set()
  if not codec or not mods <= {"qw", "pr"}:
    return set(), spec
  return mods, codec


def energy(tokens: np.ndarray, queries: np.ndarray, rows: int = 100_000, seed: int = 0) -> dict:
  """Where the tokens' and the queries' energy lies (a seeded sample of `rows` tokens)."""
  rng = np.random.default_rng(seed)
  x = tokens[np.sort(rng.choice(len(tokens), min(rows, len(tokens)), replace=False))].astype(
      np.float64)
  mean = x.mean(0)
  centered = x - mean
  values, vectors = np.linalg.eigh(centered.T @ centered / len(x))
  values, vectors = values[::-1], vectors[:, ::-1]
  q = queries.astype(np.float64)
  # Each query's score variance over tokens, q C q, by the tokens' principal directions.
  score_variance = ((q @ vectors) ** 2 * values).mean(0)
  q_values = np.linalg.eigvalsh(q.T @ q / len(q))[::-1]
  share = lambda v, n: float(v[:n].sum() / v.sum())
  return {"mean_share_of_energy": float(mean @ mean / (x ** 2).sum(1).mean()),
          "token_variance_top": {n: share(values, n) for n in (1, 10, 32, 96)},
          "score_variance_top": {n: share(score_variance, n) for n in (1, 10, 32, 96)},
          "question_energy_top": {n: share(q_values, n) for n in (1, 10, 32)}}


def render(results: dict, command: str) -> str:
  e = results["energy"]
  lines = ["# How well each code keeps the token scores (SQuAD-open small, dense)", "",
           f"Rendered by `{command}` at {results['commit']}; {results['kept_tokens']:,} kept "
           f"tokens (filter threshold {results['threshold']}), {results['questions']:,} dev "
           "questions' "
           f"start and end vectors ({2 * results['questions']:,} queries), model step "
           f"{results['model_step']}; codecs trained on {results['sample']:,} kept tokens.", "",
           "| codec | bytes | exact best = decoded best | in decoded top 10 | in decoded top 100 "
           "| exact top 10 in decoded top 100 | score error / top-100 spread | dense EM@1 | "
           "passage Top-1 | Top-20 | train s | encode s |", "|---" * 12 + "|"]
  for r in results["rows"]:
    lines.append(f"| {r['codec']} | {r['code_bytes']} | {r['top1_at1']:.3f} | "
                 f"{r['top1_at10']:.3f} | {r['top1_at100']:.3f} | {r['recall10_at100']:.3f} | "
                 f"{r['rel_score_err']:.2f} | "
                 + " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in ("em@1", "top1", "top20"))
                 + f" | {r['train_s']:.0f} | {r['encode_s']:.0f} |")
  lines += ["", f"The mean token vector holds {100 * e['mean_share_of_energy']:.1f}% of E|x|^2; "
            "the tokens' top 1/10/32/96 principal directions hold "
            + "/".join(f"{100 * v:.0f}" for v in e["token_variance_top"].values())
            + "% of their variance and "
            + "/".join(f"{100 * v:.0f}" for v in e["score_variance_top"].values())
            + "% of the queries' score variance over tokens; the queries' top 1/10/32 directions "
            "hold " + "/".join(f"{100 * v:.0f}" for v in e["question_energy_top"].values())
            + "% of their energy."]
  if "within_passage_variance_share" in e:
    lines[-1] += (f" Within their passages the tokens keep "
                  f"{100 * e['within_passage_variance_share']:.0f}% of their variance (about "
                  "their passages' means).")
  if "passage_recall" in results:
    r = results["passage_recall"]
    lines += ["", f"The query's exact best token lies in one of its top-N passages (of "
              f"{r['passages']:,}) by its score of the passages' mean kept vectors: "
              + ", ".join(f"N = {n}: {100 * v:.1f}%" for n, v in r.items() if n != "passages")
              + "."]
  commits = sorted({row.get("commit", results["commit"]) for row in results["rows"]})
  if commits != [results["commit"]]:
    short = lambda c: c[:12] + c[40:]  # (a "-dirty" suffix kept)  # noqa: E731
    lines += ["", "Rows measured at " + ", ".join(map(short, commits)) + " (kept from "
              "the earlier run of the same setup; the energy and passage figures at "
              f"{short(results['commit'])})."]
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--threshold", type=float, required=True, help="the filter's, kept tokens")
  parser.add_argument("--codecs", nargs="+", required=True,
                      help="faiss factory strings; qw:<codec> question-weighted")
  parser.add_argument("--questions", type=int, default=1000)
  parser.add_argument("--train-questions", type=int, default=4000)
  parser.add_argument("--sample", type=int, default=100_000)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--em", action="store_true",
                      help="each codec's dense EM@1 / passage Top-k over its decoded tokens")
  parser.add_argument("--out", required=True)
  parser.add_argument("--note", action="append", default=[])
  args = parser.parse_args(argv)
  import faiss
  faiss.omp_set_num_threads(len(os.sched_getaffinity(0)))
  from dpjax.data import Tokenizer
  from dpjax.data.questions import read_questions, sample_questions
  from dpjax.data import data_files
  from dpjax.main import open_workdir, restore
  from dpjax.models.encoders import encode_questions
  from dpjax.parallel import make_mesh, round_to_devices
  settings, workdir, dump, questions = open_workdir(args.config, args.workdir)
  model, step = restore(settings, workdir)
  tokenizer, mesh = Tokenizer.from_pretrained(settings.model.tokenizer), make_mesh()
  encode = lambda texts: np.concatenate(encode_questions(
      model, tokenizer, texts, max_query_length=settings.data.max_query_length,
      batch_size=round_to_devices(settings.eval.batch_size, mesh), mesh=mesh)).astype(np.float32)
  queries = encode([q.question for q in questions[:args.questions]])
  train = sample_questions(read_questions(data_files(settings.data, workdir)["train"]),
                           args.train_questions, args.seed)
  train_queries = encode([q.question for q in train])
  kept = np.flatnonzero(dump.filter_logits.astype(np.float32).max(1) >= args.threshold)
  tokens = np.asarray(dump.vectors[kept], np.float32)
  rng = np.random.default_rng(args.seed)
  sample_rows = np.sort(rng.choice(len(tokens), min(args.sample, len(tokens)), replace=False))
  exact_ids, exact_scores = exact_top(queries, tokens)
  setup = {"config": args.config, "model_step": step, "threshold": args.threshold,
           "kept_tokens": int(len(kept)), "questions": args.questions,
           "train_questions": len(train), "sample": len(sample_rows), "seed": args.seed}
  out = pathlib.Path(args.out)
  earlier = json.loads(out.read_text()) if out.is_file() else {}
  done = {r["codec"]: r for r in earlier.get("rows", [])
          if {k: earlier.get(k) for k in setup} == setup}
  commit = git_commit()
  results = {"commit": commit, **setup, "energy": energy(tokens, queries, seed=args.seed),
             "notes": args.note, "rows": []}
  shown = elide_notes(sys.argv[1:] if argv is None else argv)
  passages = np.asarray(dump.token_passage[kept])
  centered = tokens - tokens.mean(0)
  within = tokens - passage_means(tokens, passages)
  results["energy"]["within_passage_variance_share"] = float(
      (within ** 2).sum(1).mean() / (centered ** 2).sum(1).mean())
  del centered, within
  results["passage_recall"] = passage_recall(queries, tokens, passages, exact_ids[:, 0])
  answers = [q.answers for q in questions[:args.questions]]

  def dense_scores(decoded: np.ndarray) -> dict:
    """The dense figures over the decoded kept rows (zeros elsewhere; the [T, D] float32 array
    made only when a codec is measured, not when every row is kept)."""
    full = np.zeros(dump.vectors.shape, np.float32)
    full[kept] = decoded
    return search_scores(dataclasses.replace(dump, vectors=full), kept, queries, answers,
                         settings.eval)
  for spec in args.codecs:
    if spec in done and (not args.em or "em@1" in done[spec]):
      results["rows"].append({"commit": earlier["commit"], **done[spec]})
      save_results(args.out, results, render, "experiments/benchmarks/codec_scores.py", shown)
      continue
    mods, codec = parse_codec(spec)
    to_codes, to_queries = (question_weighting(train_queries) if "qw" in mods
                            else (lambda x: x, lambda q: q))
    space = to_codes(tokens)  # (the tokens themselves when not weighted: not changed here)
    means = passage_means(space, passages) if "pr" in mods else np.float32(0.0)
    space = space - means
    decoded, trained, encoded, size = coded(codec, space[sample_rows], space)
    decoded += means
    del space, means
    row = {"codec": spec, "commit": commit, "code_bytes": size, "train_s": trained,
           "encode_s": encoded,
           **agreement(queries, decoded, exact_ids, exact_scores, to_queries(queries))}
    if args.em:
      row.update(dense_scores(to_original(decoded, train_queries) if "qw" in mods
                              else decoded))
    results["rows"].append(row)
    save_results(args.out, results, render, "experiments/benchmarks/codec_scores.py", shown)
  return 0


if __name__ == "__main__":
  sys.exit(main())
