"""How long and how far apart the dump's windows are (`index.dump_max_seq_length`,
`index.dump_min_context`): the tokens a dump encodes against what its stored vectors and the
retrieval over them become.

  python experiments/studies/dump_windows.py --config experiments/squad.py:cpu-base --workdir W \\
      --corpus ../shared/data/squad/dev-v1.1.json --max-seq-length 192 256 384 \\
      --min-context 0 32 --out results/dump_windows.json

For each window length and `--min-context` value (every pair; default length: the config's)
the corpus (default: the config's, `index.corpus`) is dumped by `run.py dump`'s code with the
workdir's model into W/dump_windows_<length>_mc<N> (`index.dump_name`; a complete dump of the
same settings is reused), a Flat index is built over it, and every evaluation question
(`index.questions`, default the dev split; `eval.limit`) is answered as `run.py eval` answers
it: EM@1 / EM@10 of the top-10 phrases, passage Top-1 / Top-20. Reported per pair:
- windows: the windows the dump encodes and their real tokens ([CLS], title, [SEP] and context)
  per stored token (`build_windows` with the dump's settings): at the encoder's speed per
  encoded token, a dump stores at most stored / encoded of it;
- the stored vectors against those of the first pair (e.g. the trained length with
  `--min-context 0`: a window every `data.doc_stride` tokens, as the model was trained): max
  and mean |diff| and the share of tokens whose vector moved by more than 0.01 anywhere;
- the retrieval figures, each paired with the first pair's and with the config's own pair's
  over the same questions (McNemar's exact test on the questions only one of the two answers
  right).
The dump's seconds are recorded too, but the dump's speed is `experiments/benchmarks/speed.py`'s
(a timed warm dump on an idle machine); here each pair is dumped once.
"""
from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from experiments.report import mcnemar_p, p_text, with_notes  # noqa: E402

METRICS = ("em@1", "em@10", "top1", "top20")
CHANGED = 0.01  # a stored vector "moved" when a component moved by more than this


def dump_name(length: int, min_context: int) -> str:
  return f"dump_windows_{length}_mc{min_context}"


def window_tokens(config, tokenizer, passages, mesh, manifest: dict) -> dict:
  """The dump's windows of the passages: count and real tokens, as its manifest records them, or
  (a dump made before it counted them) cut again as `run.py dump` cuts them."""
  if manifest.get("encoded_tokens") is not None:
    return {"windows": manifest["num_windows"], "tokens_encoded": manifest["encoded_tokens"]}
  from dpjax.index.manifest import dump_config
  from dpjax.index.window_maker import shard_windows
  windows = shard_windows(tokenizer, passages, dump_config(config.data, config.index,
                                                            config.model.dtype, mesh))
  return {"windows": len(windows.input_ids), "tokens_encoded": int(windows.attention_mask.sum())}


def vector_changes(a, b, chunk: int = 65536) -> dict:
  """How far the stored vectors `b` are from `a` (same tokens, [T, D] float16)."""
  if a.shape != b.shape:
    raise SystemExit(f"the dumps store different tokens: {a.shape} vs {b.shape}")
  worst, total, moved = 0.0, 0.0, 0
  for lo in range(0, len(a), chunk):
    diff = np.abs(a[lo:lo + chunk].astype(np.float32) - b[lo:lo + chunk].astype(np.float32))
    token_max = diff.max(1)
    worst = max(worst, float(token_max.max(initial=0.0)))
    total += float(diff.sum())
    moved += int((token_max > CHANGED).sum())
  return {"max_abs_diff": worst, "mean_abs_diff": total / max(a.size, 1),
          "tokens_moved": moved / max(len(a), 1)}


def load(args, *sets: str):
  """The config with `--set`, `--corpus` and then `sets` applied."""
  from dpjax.config import load_config
  from dpjax.settings import Settings
  corpus = ([f"index.corpus={[str(pathlib.Path(c).resolve()) for c in args.corpus]!r}"]
            if args.corpus else [])
  return Settings.of(load_config(args.config, [*args.set, *corpus, *sets]))


def measure(args, length: int, min_context: int, passages, questions, vectors, tokenizer,
            mesh) -> dict:
  """One pair: dump (or reuse), Flat index, the questions answered; its figures and hits."""
  from dpjax.index.dump_reader import Dump
  from dpjax.index.evaluate import retrieval_scores
  from dpjax.index.faiss_index import build_index
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.main import dump
  from dpjax.loading import data_paths
  config = load(args, f"index.dump_min_context={min_context}",
                f"index.dump_max_seq_length={length}",
                f"index.dump_name={dump_name(length, min_context)!r}")
  manifest = dump.run(config, args.workdir)
  dump_dir = data_paths(config.data, config.index, args.workdir)["dump"]
  build_index(dump_dir, "Flat")
  index = PhraseIndex(dump_dir, "Flat")
  scores = retrieval_scores(index, *vectors, [q.answers for q in questions],
                            max_answer_length=config.eval.max_answer_length, passage_k=20,
                            per_question=True, shared_hits=True)
  seconds = manifest.get("seconds")
  return {"max_seq_length": length, "min_context": min_context,
          **window_tokens(config, tokenizer, passages, mesh, manifest),
          "tokens_stored": manifest["num_tokens"], "passages": manifest["num_passages"],
          "dump_seconds": seconds, "dump_dir": str(dump_dir),
          **{m: scores[m] for m in METRICS}, "hits": scores["hits"],
          "vectors": Dump.load(dump_dir).vectors}


def study(args) -> dict:
  """Every (window length, `--min-context`) pair measured; the figures (JSON-ready)."""
  from dpjax.data import Tokenizer
  from dpjax.data.corpus import read_corpus
  from dpjax.data.questions import read_questions
  from dpjax.models.encoders import encode_questions
  from dpjax.index.manifest import dump_config
  from dpjax.parallel import make_mesh
  from dpjax.loading import data_paths
  from dpjax.main import restore
  config = load(args)
  passages = list(read_corpus(data_paths(config.data, config.index, args.workdir)["corpus"]))  # for the windows
  questions = read_questions(data_paths(config.data, config.index, args.workdir)["questions"])
  questions = questions[:config.eval.limit or None]
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  mesh = make_mesh(local=True)
  model, step = restore(config, args.workdir)
  vectors = encode_questions(model, tokenizer, [q.question for q in questions],  # once: one model
                             max_query_length=config.data.max_query_length,
                             batch_size=config.eval.batch_size, mesh=mesh)
  del model
  settings = dump_config(config.data, config.index, config.model.dtype, mesh)  # its own windows
  shipped = {"max_seq_length": settings.max_seq_length, "min_context": settings.min_context}
  lengths = args.max_seq_length or [shipped["max_seq_length"]]
  runs, first = [], None
  for length, min_context in itertools.product(lengths, args.min_context):
    run = measure(args, length, min_context, passages, questions, vectors, tokenizer, mesh)
    stored = run.pop("vectors")
    first = stored if first is None else first
    run["vectors_vs_first"] = vector_changes(first, stored)
    run["encoded_per_stored"] = run["tokens_encoded"] / max(run["tokens_stored"], 1)
    runs.append(run)
  results = {"config": args.config, "overrides": args.set, "workdir": str(args.workdir),
             "model_step": step, "corpus": ", ".join(args.corpus) or "the config's",
             "questions": len(questions), "shipped": shipped, "runs": runs,
             "notes": args.note}
  add_paired(results)
  return results


def _pair(run: dict) -> str:
  return f"{run['max_seq_length']} / {run['min_context']}"


def add_paired(results: dict) -> None:
  """Each run's EM@1 / Top-20 paired with the first value's (`vs_first`) and, when it is
  measured too (and not first), with the config's own pair's (`vs_shipped`): the questions
  only this run answers right, only that one, McNemar's p."""
  runs = results["runs"]
  for key, reference in (("vs_first", runs[0]), ("vs_shipped", _shipped(results))):
    for run in runs:
      if reference is not None and run is not reference:
        run[key] = {m: dict(zip(("only_this", "only_that", "p"),
                                mcnemar_p(run["hits"][m], reference["hits"][m])))
                    for m in ("em@1", "top20")}


def markdown(results: dict, command: str) -> str:
  runs, first = results["runs"], results["runs"][0]
  sets = "".join(f" --set {o}" for o in results["overrides"])
  lines = ["# The dump's windows: encoded tokens against vectors and retrieval", "",
           f"Command: `{command}`", "",
           f"Model: `{results['workdir']}` (step {results['model_step']}), config "
           f"`{results['config']}`{sets}; corpus: {results['corpus']}; "
           f"{first['passages']:,} passages, {first['tokens_stored']:,} stored tokens; "
           f"{results['questions']:,} questions, exact (Flat) index. The config's dump "
           f"windows: {_pair(results['shipped'])} (length / min_context).", "",
           "| length / min_context | windows | encoded tokens | per stored token "
           "| stored / encoded | vectors vs first: max / mean abs diff, tokens moved > 0.01 "
           "| dump s | " + " | ".join(METRICS) + " |",
           "|" + "---|" * (7 + len(METRICS))]
  for run in runs:
    v = run["vectors_vs_first"]
    lines.append(
        f"| {_pair(run)} | {run['windows']:,} | {run['tokens_encoded']:,} | "
        f"{run['encoded_per_stored']:.3f} | {1 / run['encoded_per_stored']:.3f} | "
        f"{v['max_abs_diff']:.3g} / {v['mean_abs_diff']:.2g}, {100 * v['tokens_moved']:.2f}% | "
        f"{run['dump_seconds'] or 0:.0f} | " + " | ".join(f"{run[m]:.2f}" for m in METRICS)
        + " |")
  for key, reference in (("vs_first", first), ("vs_shipped", _shipped(results))):
    if reference is not None and any(key in run for run in runs):
      lines += ["", *_paired_table(runs, key, reference)]
  return with_notes(lines, results.get("notes", []))


def _shipped(results: dict) -> dict | None:
  """The run of the config's own pair, unless it is the first (its table is the first's)."""
  runs = [r for r in results["runs"][1:] if _pair(r) == _pair(results["shipped"])]
  return runs[0] if runs else None


def _paired_table(runs: list, key: str, reference: dict) -> list[str]:
  lines = [f"Paired with {_pair(reference)} (the same questions; McNemar's "
           "exact test on the questions only one of the two gets right):", "",
           "| length / min_context | EM@1 diff | this only / that only | p | Top-20 diff | "
           "this only / that only | p |", "|---|---|---|---|---|---|---|"]
  for run in runs:
    if key not in run:
      continue
    cells = []
    for metric in ("em@1", "top20"):
      t = run[key][metric]
      cells += [f"{run[metric] - reference[metric]:+.2f}",
                f"{t['only_this']} / {t['only_that']}", p_text(t["p"])]
    lines.append(f"| {_pair(run)} | " + " | ".join(cells) + " |")
  return lines


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, type=pathlib.Path,
                      help="a trained workdir; the dumps go into it")
  parser.add_argument("--min-context", type=int, nargs="+", required=True,
                      help="index.dump_min_context values")
  parser.add_argument("--max-seq-length", type=int, nargs="*", default=[],
                      help="window lengths (index.dump_max_seq_length; default: the config's); "
                           "the first length with the first min_context is the reference")
  parser.add_argument("--corpus", nargs="*", default=[],
                      help="corpus files (SQuAD JSON or JSONL; default: the config's)")
  parser.add_argument("--out", required=True, help="results JSON (the .md goes beside it)")
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph printed after the tables")
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)
  for name, values, least in (("--min-context", args.min_context, 0),
                              ("--max-seq-length", args.max_seq_length, 1)):
    if len(set(values)) != len(values) or min(values, default=least) < least:
      raise SystemExit(f"{name} {values}: distinct values >= {least} expected")
  from dpjax.config import setup_logging
  setup_logging(fmt="%(asctime)s %(message)s")
  from experiments.report import elide_notes, save_results
  results = study(args)
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  save_results(args.out, results, markdown, "experiments/studies/dump_windows.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
