"""The dump's host side alone: what it allows an encoder, and where its seconds go.

  python experiments/benchmarks/dump_host.py --config experiments/squad.py \\
      --workdir workdirs/squad-cpu --passages 4000 --out results/dump_host.json

`run.py dump`'s whole pipeline (tokenizer workers, length-bucketed calls of the accelerator's
shapes, the outputs fetched, the kept tokens written by the writer thread, the shard sealed) with
the phrase encoder replaced by one that computes nothing (it returns the mask broadcast to the
vectors' shape, float16, as the real one's outputs): its stored tokens/s is the most the host
lets a dump reach, whatever the device, and the manifest's split (`dpjax.index.dump._host_times`)
says where the host's seconds go. The calls take the accelerator's shapes (`index.batch_size`
rows, widths at multiples of `index.dump_width_multiple`) on this machine's CPU. Medians of
`--repeats` runs, each into a fresh folder (removed after). Writes the JSON and a Markdown report.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

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


def markdown(results: dict, command: str) -> str:
  from experiments.report import with_notes
  runs = results["median"]
  c = results["config"]
  return with_notes([
      "# The dump's host side alone (experiments/benchmarks/dump_host.py)", "",
      f"Command: `{command}` at {results['commit'][:10]}, {results['machine']}.", "",
      f"{results['passages']:,} corpus passages, {results['num_tokens']:,} stored tokens; "
      f"calls of {c['batch_size']} rows at widths of multiples of {c['width_multiple']}, "
      f"{c['workers']} tokenizer processes; the encoder computes nothing. Medians of "
      f"{results['repeats']} runs.", "",
      "| figure | median |", "|---|---|",
      f"| stored tokens/s (the host's ceiling) | {runs['stored_tokens_per_s']:,.0f} |",
      *[f"| {key} | {runs[key]:.2f} |" for key in SPLIT],
      ], results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="a workdir with a checkpoint and data")
  parser.add_argument("--passages", type=int, default=4000, help="corpus passages dumped")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--scratch", default="workdirs/dump_host", help="the dumps' folder")
  parser.add_argument("--out", required=True)
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph printed after the table")
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)

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
  from experiments.benchmarks.scale import machine
  from experiments.report import git_commit, save_results

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
  median = {key: statistics.median(r[key] for r in runs) for key in (*SPLIT, "wall_seconds")}
  median["stored_tokens_per_s"] = statistics.median(r["num_tokens"] / r["seconds"] for r in runs)
  results = {"commit": git_commit(), "machine": f"{machine()}, {os.cpu_count()} cores",
             "passages": len(passages),
             "num_tokens": runs[0]["num_tokens"], "repeats": args.repeats,
             "config": {"batch_size": config.batch_size,
                        "width_multiple": config.width_multiple,
                        "workers": settings.index.dump_workers},
             "runs": runs, "median": median, "notes": args.note}
  save_results(args.out, results, markdown, "experiments/benchmarks/dump_host.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
