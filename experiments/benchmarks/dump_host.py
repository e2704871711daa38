"""The dump's host side alone: what it allows an encoder, and where its seconds go.

  python experiments/benchmarks/dump_host.py --config experiments/squad.py \\
      --workdir workdirs/squad-cpu --passages 30000 --out results/dump_host.json \\
      [--vs /work/wt-old --pairs 5]

`run.py dump`'s whole pipeline (tokenizer workers, length-bucketed calls of the accelerator's
shapes, the outputs fetched, the kept tokens written by the writer thread, the shards sealed)
with the phrase encoder replaced by one that computes nothing (it returns the mask broadcast to
the vectors' shape, float16, as the real one's outputs): its stored tokens/s is the most the host
lets a dump reach, whatever the device, and the manifest's split (`dpjax.index.dump._host_times`)
says where the host's seconds go. The calls take the accelerator's shapes (`index.batch_size`
rows, widths at multiples of `index.dump_width_multiple`) on this machine's CPU. Each process
dumps `--repeats` + 1 times into fresh folders (removed after), the first to compile.

`--vs TREE` (a git worktree of other code) times both trees' dpjax, a process each, in turn for
`--pairs` pairs, and gives the ratio of this tree's stored tokens/s to the other's pair by pair.
Writes the JSON and a Markdown report.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # dpjax and experiments, when run as a script

SPLIT = ("seconds", "encoder_wait_seconds", "host_seconds", "pipeline_wait_seconds",
         "write_wait_seconds", "dispatch_seconds", "fetch_seconds", "host_cpu_seconds",
         "compile_seconds")


def null_encoder(dim: int):
  """A jitted `fn(input_ids, attention_mask)` -> ([B, L, dim] float16, [B, L, 2] float16) that
  computes nothing but its outputs."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def encode(input_ids, attention_mask):
    mask = attention_mask[..., None].astype(jnp.float16)
    return (jnp.broadcast_to(mask, (*input_ids.shape, dim)),
            jnp.broadcast_to(mask, (*input_ids.shape, 2)))
  return encode


def _dump(dump_module, model, tokenizer, passages, config, mesh, workers: int,
          folder: pathlib.Path) -> dict:
  """One dump into `folder` (removed after): its manifest's split, tokens and wall seconds."""
  shutil.rmtree(folder, ignore_errors=True)
  start = time.perf_counter()
  manifest = dump_module.dump_phrases(model, tokenizer, passages, folder, config, mesh=mesh,
                                      workers=workers)
  wall = time.perf_counter() - start
  shutil.rmtree(folder)
  return {**{key: manifest[key] for key in (*SPLIT, "num_tokens")}, "wall_seconds": wall}


def measure(args) -> dict:
  """This process's dumps: {"passages", "config", "runs"} (the compiling run left out)."""
  import itertools

  from dpjax.config import load_config
  from dpjax.data import Tokenizer
  from dpjax.data.corpus import read_corpus
  from dpjax.index import dump as dump_module
  from dpjax.index.manifest import dump_config
  from dpjax.loading import data_paths
  from dpjax.main import restore
  from dpjax.models import encoders
  from dpjax.parallel import make_mesh
  from dpjax.settings import Settings
  from dpjax.workdir import Workdir

  settings = Settings.of(load_config(args.config, args.set))
  workdir = Workdir(args.workdir)
  model, _ = restore(settings, workdir)
  mesh = make_mesh(local=True)
  config = dump_config(settings.data, settings.index, settings.model.dtype, mesh)
  passages = list(itertools.islice(read_corpus(data_paths(settings.data, settings.index,
                                                          workdir)["corpus"]), args.passages))
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  # The accelerator's calls (`phrase_calls`), and the encoder that computes nothing: the
  # modules' functions replaced for these dumps only.
  encode = null_encoder(model.config.hidden_size)  # one jit: compiled in the first run only
  kept = encoders._on_cpu, dump_module.bound
  encoders._on_cpu, dump_module.bound = (lambda mesh: False), (lambda model, name: encode)
  try:
    runs = [_dump(dump_module, model, tokenizer, passages, config, mesh,
                  settings.index.dump_workers, pathlib.Path(args.scratch) / f"run{repeat}")
            for repeat in range(args.repeats + 1)][1:]  # the first run compiles the shapes
  finally:
    encoders._on_cpu, dump_module.bound = kept
  return {"passages": len(passages), "runs": runs,
          "config": {"batch_size": config.batch_size, "width_multiple": config.width_multiple,
                     "workers": settings.index.dump_workers}}


def median_of(runs: list[dict]) -> dict:
  """Each split figure's median over `runs`, and the median stored tokens/s."""
  median = {key: statistics.median(r[key] for r in runs) for key in (*SPLIT, "wall_seconds")}
  median["stored_tokens_per_s"] = statistics.median(r["num_tokens"] / r["seconds"] for r in runs)
  return median


def versus(args, argv: list[str]) -> tuple[dict, dict]:
  """`--pairs` pairs of child processes, this tree's and `--vs`'s dpjax in turn (which first
  alternates): (each tree's runs and medians and the pairs' ratios of stored tokens/s, this
  tree's `measure` record with all its runs)."""
  trees = {"this": REPO, "other": pathlib.Path(args.vs).resolve()}
  child = _without(argv, ("--vs", "--pairs", "--out", "--note"))
  found = {name: [] for name in trees}
  ratios, mine = [], None
  with tempfile.TemporaryDirectory(prefix="dpjax-dump-host-") as tmp:
    for pair in range(args.pairs):
      order = list(trees) if pair % 2 == 0 else list(reversed(trees))
      rates = {}
      for name in order:
        out = pathlib.Path(tmp) / f"{name}{pair}.json"
        subprocess.run([sys.executable, __file__, *child, "--code", str(trees[name]),
                        "--child", str(out)], check=True, cwd=REPO)
        record = json.loads(out.read_text())
        runs = record["runs"]
        found[name] += runs
        mine = record if name == "this" and mine is None else mine
        rates[name] = median_of(runs)["stored_tokens_per_s"]
      ratios.append(rates["this"] / rates["other"])
  git = lambda tree: subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"],
                                    capture_output=True, text=True).stdout.strip()
  return ({"trees": {name: {"path": str(tree), "commit": git(tree), "runs": found[name],
                            "median": median_of(found[name])} for name, tree in trees.items()},
           "pairs": args.pairs, "ratios": ratios, "ratio_median": statistics.median(ratios)},
          {**mine, "runs": found["this"]})


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
  """`argv` without `flags` and their values."""
  kept, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg in flags:
      skip = True
    else:
      kept.append(arg)
  return kept


def markdown(results: dict, command: str) -> str:
  from experiments.report import with_notes
  c = results["config"]
  lines = ["# The dump's host side alone (experiments/benchmarks/dump_host.py)", "",
           f"Command: `{command}` at {results['commit'][:10]}, {results['machine']}.", "",
           f"{results['passages']:,} corpus passages, {results['num_tokens']:,} stored tokens; "
           f"calls of {c['batch_size']} rows at widths of multiples of {c['width_multiple']}, "
           f"{c['workers']} tokenizer processes; the encoder computes nothing. Medians of "
           f"{len(results['runs'])} dumps (the compiling one left out)."]
  vs = results.get("versus")
  keys = ("stored_tokens_per_s", *SPLIT)
  if vs is None:
    lines += ["", "| figure | median |", "|---|---|"]
    lines += [f"| {key} | {results['median'][key]:,.2f} |" for key in keys]
  else:
    this, other = vs["trees"]["this"], vs["trees"]["other"]
    lines += ["", f"This tree ({this['commit'][:10]}) against {other['path']} "
              f"({other['commit'][:10]}), a process each in turn, {vs['pairs']} pairs; "
              f"this tree's stored tokens/s over the other's, pair by pair: "
              + ", ".join(f"{r:.3f}" for r in vs["ratios"])
              + f" (median {vs['ratio_median']:.3f}).", "",
              f"| figure | {this['commit'][:10]} | {other['commit'][:10]} |", "|---|---|---|"]
    lines += [f"| {key} | {this['median'][key]:,.2f} | {other['median'][key]:,.2f} |"
              for key in keys]
  return with_notes(lines, results.get("notes", []))


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="a workdir with a checkpoint and data")
  parser.add_argument("--passages", type=int, default=4000, help="corpus passages dumped")
  parser.add_argument("--repeats", type=int, default=3, help="timed dumps a process")
  parser.add_argument("--scratch", default="workdirs/dump_host", help="the dumps' folder")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--vs", help="a worktree of other code, timed in turn with this one")
  parser.add_argument("--pairs", type=int, default=5, help="with --vs: pairs of processes")
  parser.add_argument("--code", help=argparse.SUPPRESS)  # a child's tree (`versus`)
  parser.add_argument("--child", help=argparse.SUPPRESS)  # a child's runs go there
  parser.add_argument("--out", help="the JSON (and the Markdown beside it)")
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph printed after the table")
  args = parser.parse_args(argv)
  if not (args.out or args.child):
    parser.error("--out is required")
  return args


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if args.child:  # dpjax of the given tree, ahead of this one's
    sys.path.insert(0, args.code)
    pathlib.Path(args.child).write_text(json.dumps(measure(args)))
    return 0
  from experiments.benchmarks.scale import machine
  from experiments.report import elide_notes, git_commit, save_results
  if args.vs:
    vs, measured = versus(args, argv)
  else:
    vs, measured = None, measure(args)
  results = {"commit": git_commit(), "machine": f"{machine()}, {os.cpu_count()} cores",
             **measured, "num_tokens": measured["runs"][0]["num_tokens"],
             "median": median_of(measured["runs"]), "versus": vs, "notes": args.note}
  save_results(args.out, results, markdown, "experiments/benchmarks/dump_host.py",
               elide_notes(argv))
  return 0


if __name__ == "__main__":
  sys.exit(main())
