"""How fast the eval path could go on this machine's cores: its work per batch in core-seconds.

`speed.py`'s eval loop (batches of 64 questions: encode, then top-10 phrases and top-20
passages from one shared index search, `retrieve`) timed on one core and on all of them, in
child processes pinned with `os.sched_setaffinity` before JAX and faiss start (so XLA's and
OpenMP's threads see those cores). The one-core time of a batch is its work; that work spread
perfectly over n cores (every stage scaling n-fold and the stages overlapping) takes 1/n of it:
the fastest any scheduling of the same computation could answer, `bound_questions_per_s`.
`questions_per_s` is the loop's on all cores with the stages in turn; `pipelined_questions_per_s`
the loop as `run.py eval` runs it (`retrieve_texts`: the next batch encoded while one is
searched), and `pipelined_used_of_bound` its share of the bound.

    python experiments/benchmarks/eval_cores.py --config experiments/squad.py:cpu \
        --workdir workdirs/speedmodel --scratch workdirs/eval_cores --out results/eval_cores.json

The scratch directory keeps the dump of SQuAD dev's first 600 passages (speed.py's settings:
min_context 32) and its Flat and IVF-SQ4 indexes for later runs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
BATCH = 64


def child(args) -> dict:
  """This process's time per batch (encode, retrieve), on the cores it was pinned to."""
  sys.path.insert(0, str(REPO))
  sys.path.insert(0, str(REPO / "experiments/benchmarks"))
  import speed
  from dpjax.index.evaluate import retrieve, retrieve_texts
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.index.search import PhraseSearcher
  config, model, tokenizer = speed._model(args)
  _, questions = speed.squad_dev(args.passages, args.questions)
  texts = [q["question"] for q in questions]
  index = PhraseIndex(pathlib.Path(args.scratch) / "dump", args.index)
  searcher = PhraseSearcher(model, index, tokenizer, max_query_length=config.data.max_query_length,
                          batch_size=BATCH)
  batches = [texts[lo:lo + BATCH] for lo in range(0, len(texts), BATCH)]
  encoded = [searcher.encode(b) for b in batches]  # every shape compiled, untimed
  kwargs = dict(shared_hits=True, max_answer_length=config.eval.max_answer_length)
  requests = [(10, "phrase"), (20, "passage")]
  times: dict[str, list[float]] = {"encode": [], "retrieve": []}
  for _ in range(args.repeats):
    start = time.perf_counter()
    encoded = [searcher.encode(b) for b in batches]
    times["encode"].append((time.perf_counter() - start) / len(batches))
    start = time.perf_counter()
    for q_start, q_end in encoded:
      retrieve(index, q_start, q_end, requests, **kwargs)
    times["retrieve"].append((time.perf_counter() - start) / len(batches))
  per_batch = {k: statistics.median(v) for k, v in times.items()}
  # The loop as `run.py eval` runs it: the next batch encoded while one is searched.
  pipelined = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    retrieve_texts(index, searcher.encode, texts, requests, chunk=BATCH, **kwargs)
    pipelined.append((time.perf_counter() - start) / len(batches))
  return {"cores": sorted(os.sched_getaffinity(0)), "seconds": times,
          "per_batch": per_batch, "batch_seconds": sum(per_batch.values()),
          "pipelined_seconds": pipelined,
          "pipelined_batch_seconds": statistics.median(pipelined)}


def make_dump(args) -> None:
  """The dump of the first passages (speed.py's new dump) and its Flat and IVF-SQ4 indexes."""
  sys.path.insert(0, str(REPO))
  sys.path.insert(0, str(REPO / "experiments/benchmarks"))
  import speed
  from dpjax.data.squad import Passage
  from dpjax.index.dump import DumpConfig, dump_phrases
  from dpjax.index.faiss_index import build_index
  from dpjax.parallel import make_mesh
  out = pathlib.Path(args.scratch) / "dump"
  if (out / "indexes" / "IVF_SQ4").exists():
    return
  config, model, tokenizer = speed._model(args)
  passages, _ = speed.squad_dev(args.passages, 0)
  dump_config = speed.dump_settings(DumpConfig, config, config.index.shard_passages,
                                    min_context=32)
  dump_phrases(model, tokenizer, [Passage(**p) for p in passages], out, dump_config,
               mesh=make_mesh(local=True))
  build_index(out, "Flat")
  build_index(out, "IVFauto,SQ4", name="IVF_SQ4")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="a trained workdir (its latest model)")
  parser.add_argument("--scratch", required=True, help="keeps the dump and its indexes")
  parser.add_argument("--index", default="IVF_SQ4")
  parser.add_argument("--passages", type=int, default=600)
  parser.add_argument("--questions", type=int, default=1280)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out")
  parser.add_argument("--cpus", help=argparse.SUPPRESS)  # a child: pinned to these cores
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  if args.cpus:
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    print(json.dumps(child(args)))
    return 0
  make_dump(args)
  cores = sorted(os.sched_getaffinity(0))
  runs = {}
  for pinned in (cores[:1], cores):
    command = [sys.executable, __file__, *argv, "--cpus", ",".join(map(str, pinned))]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    runs[len(pinned)] = json.loads(output.strip().splitlines()[-1])
  one, every = runs[1]["batch_seconds"], runs[len(cores)]["batch_seconds"]
  pipelined = runs[len(cores)]["pipelined_batch_seconds"]
  commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
  result = {"command": " ".join(["python", "experiments/benchmarks/eval_cores.py", *argv]),
            "commit": commit, "index": args.index, "questions": args.questions, "batch": BATCH,
            "cores": len(cores), "one_core": runs[1], "all_cores": runs[len(cores)],
            "questions_per_s": BATCH / every, "one_core_questions_per_s": BATCH / one,
            "bound_questions_per_s": BATCH * len(cores) / one,
            "used_of_bound": one / (len(cores) * every),
            "pipelined_questions_per_s": BATCH / pipelined,
            "pipelined_used_of_bound": one / (len(cores) * pipelined)}
  print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
