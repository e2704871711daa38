"""Encoding speed with and without length-bucketed batches, measured in one run.

  python experiments/benchmarks/encode_speed.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu-unified --out results/encode_speed.json

Two things `dpjax.parallel.map_batches` changed, each timed against the previous behaviour on
the same inputs, alternating, medians of `--repeats`:
  1. a single question (what an interactive search encodes): encoded as a batch of one cut to its
     length bucket, vs padded to the compiled batch of `index.batch_size` rows at full query length;
  2. the dump's phrase encoding of a seeded random sample of corpus passages (tokens/s of kept
     token vectors): batches of similar-length windows cut to their longest, vs every window at
     the full `data.max_seq_length`.
Compilation is excluded (every shape is warmed up first). Writes the JSON and a Markdown report.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def padded_batches(map_batches):
  """`map_batches` as it was: every batch padded to `batch_size` rows, at full width."""
  def run(fn, arrays, batch_size, mesh, lengths=None, length_multiple=32, **options):
    del lengths, length_multiple, options  # the dump's waited / pad_last: all batches are full
    n = len(arrays[0])
    extra = -n % batch_size
    full = [np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)]) for a in arrays]
    for rows, outputs in map_batches(fn, full, batch_size, mesh):
      real = rows < n
      yield rows[real], [o[real] for o in outputs]
  return run


def markdown(results: dict, command: str) -> str:
  from experiments.report import with_notes
  q, d = results["question"], results["dump"]
  return with_notes([
      "# Encoding speed: length-bucketed batches vs padded ones", "",
      f"Command: `{command}`", "",
      f"Model: `{results['workdir']}` (step {results['step']}); {results['devices']} "
      f"{results['platform']} device(s); medians of {results['repeats']} alternating runs, "
      "compilation excluded.", "",
      "| what | bucketed | padded (before) | speed-up |", "|---|---|---|---|",
      f"| one question, latency (p50 over {q['questions']} questions x {results['repeats']}) | "
      f"{q['bucketed_ms']:.1f} ms | {q['padded_ms']:.1f} ms (batch {q['batch_size']} x "
      f"{q['max_query_length']}) | {q['padded_ms'] / q['bucketed_ms']:.1f}x |",
      f"| dump encoding, {d['passages']} passages ({d['tokens']:,} kept tokens, {d['windows']} "
      f"windows of <= {d['max_seq_length']}) | {d['bucketed_tokens_per_s']:,.0f} tokens/s | "
      f"{d['padded_tokens_per_s']:,.0f} tokens/s | "
      f"{d['bucketed_tokens_per_s'] / d['padded_tokens_per_s']:.2f}x |", "",
      f"The dumped vectors are the same either way: max abs difference {d['max_abs_diff']:.2g} "
      "(float16)."], results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--questions", type=int, default=40, help="questions timed one by one")
  parser.add_argument("--passages", type=int, default=256, help="corpus passages dumped")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", required=True)
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph printed after the table (e.g. what else ran)")
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)

  import jax
  from flax import nnx

  from dpjax import parallel
  from dpjax.config import load_config
  from experiments.report import save_results
  from dpjax.data import Tokenizer
  from dpjax.data.corpus import read_corpus
  from dpjax.data.questions import read_questions
  from dpjax.data.windows import build_windows
  from dpjax.index.encode import encode_shard
  from dpjax.index.manifest import training_windows_config
  from dpjax.models import encoders as encoders_module
  from dpjax.parallel import make_mesh, round_to_devices
  from dpjax.loading import data_paths
  from dpjax.main import restore
  from dpjax.settings import Settings

  config = Settings.of(load_config(args.config, args.set))
  workdir = pathlib.Path(args.workdir)
  paths = data_paths(config.data, config.index, workdir)
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  model, step = restore(config, workdir)
  graphdef, state = nnx.split(model)
  encoders = encoders_module.make_encoders(graphdef)
  mesh = make_mesh()
  batch_size = round_to_devices(config.index.batch_size, mesh)
  bucketed, padded = parallel.map_batches, padded_batches(parallel.map_batches)

  def use(map_batches):  # the one function both encoders go through
    parallel.map_batches = encoders_module.map_batches = map_batches

  questions = [q.question for q in read_questions(paths["questions"])][:args.questions]
  corpus = list(read_corpus(paths["corpus"]))
  rng = np.random.default_rng(0)
  sample = [corpus[i] for i in np.sort(rng.choice(len(corpus), min(args.passages, len(corpus)),
                                                  replace=False))]
  dump_config = training_windows_config(config.data, batch_size)
  encode_phrases = lambda i, m: encoders.phrases_and_filter(state, i, m)
  question_encoders = encoders_module.QuestionEncoders(
      lambda i, m: encoders.questions(state, i, m),
      lambda i, s, p: encoders.packed_questions(state, i, s, p))

  def one_by_one() -> list[float]:
    times = []
    for q in questions:
      start = time.perf_counter()
      ids, mask = tokenizer.encode([q], config.data.max_query_length)
      if parallel.map_batches is padded:  # as it was: a batch of rows at full width
        list(padded(question_encoders.padded, [ids, mask], batch_size, mesh))
      else:
        encoders_module.question_vectors(question_encoders, ids, mask, batch_size=batch_size,
                                         mesh=mesh)
      times.append(time.perf_counter() - start)
    return times

  def dump_sample():
    return encode_shard(tokenizer, sample, dump_config, mesh, encode_phrases)

  results = {"workdir": str(workdir), "step": step, "devices": mesh.size,
             "platform": jax.devices()[0].platform, "repeats": args.repeats,
             "notes": args.note}
  per_question, dump_seconds = {}, {}
  try:
    vectors = {}
    for name, fn in (("bucketed", bucketed), ("padded", padded)):  # compile every shape
      use(fn)
      one_by_one()
      vectors[name] = dump_sample()["vectors"].astype(np.float32)
    tokens = len(vectors["bucketed"])
    for _ in range(args.repeats):
      for name, fn in (("bucketed", bucketed), ("padded", padded)):
        use(fn)
        per_question.setdefault(name, []).extend(one_by_one())
        start = time.perf_counter()
        dump_sample()
        dump_seconds.setdefault(name, []).append(time.perf_counter() - start)
  finally:
    use(bucketed)
  windows, _ = build_windows(
      tokenizer, sample,
      max_seq_length=dump_config.max_seq_length, doc_stride=dump_config.doc_stride,
      include_title=dump_config.include_title)
  results["question"] = {"questions": len(questions), "batch_size": batch_size,
                         "max_query_length": config.data.max_query_length,
                         **{f"{k}_ms": 1000 * statistics.median(v)
                            for k, v in per_question.items()}}
  results["dump"] = {"passages": len(sample), "windows": len(windows.input_ids), "tokens": tokens,
                     "max_seq_length": dump_config.max_seq_length,
                     # the same vectors either way (up to float16 rounding of tiny differences)
                     "max_abs_diff": float(np.abs(vectors["bucketed"] - vectors["padded"]).max()),
                     **{f"{k}_tokens_per_s": tokens / statistics.median(v)
                        for k, v in dump_seconds.items()}}
  from experiments.report import elide_notes
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  save_results(args.out, results, markdown, "experiments/benchmarks/encode_speed.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
