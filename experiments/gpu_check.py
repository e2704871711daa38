"""The full-scale check: train the default, dump, index and answer SQuAD-open small, then speed.

Stages, in order, each a `run.py` (or benchmark) process under a time limit cut to what is left
of `--deadline`; OUT/gpu_check.json is rewritten after every stage, so a timeout keeps what
finished. Every figure in it is read from the files the processes wrote.

  train      `run.py train` of the config (and of each `--alt` candidate, alongside): its RC
             EM/F1 on the dev questions (results.json), wall time, steps and time per step, and
             where the wall went: data, compiles, steps, RC eval (metrics.jsonl's "timing"); a
             `--teacher` candidate's cross-encoder teacher first (`run.py teacher`), which it
             is then trained to imitate (train.teacher_logits)
  chain      per candidate: `run.py dump`, `run.py index` (Flat), `run.py eval` (dense):
             EM@1/10, passage Top-1/5/20, MRR@20, questions/s; the dump's stored tokens/s
  hybrid     per candidate: `run.py index` of the BM25 index (weights chosen on training
             questions) and `run.py eval` with it (figures `hybrid_*`); with the chain stage,
             alongside its dense eval (both wait on the host far more than on the device)
  step       experiments/benchmarks/train_step.py: the recipe's bf16 step (its dropout) on
             XLA's attention; `step_pallas` the same on the Pallas kernel
  dump_warm  the default's dump again into another folder, executables from the compile cache
  flash_tests  tests/test_flash_attention.py compiled for the GPU (not run by default)
  eval_profile  the default's dense eval of PROFILE_QUESTIONS questions under cProfile, its
             summary in the logs (not run by default)

Each timing stage also reports the model FLOPs it did and their share of the devices' bf16 peak
(MFU; `*_flops`, `*_flops_per_s`, `*_mfu`; the formula in docs/performance.md).

  python experiments/gpu_check.py --workdir /root/w/check --out $OUT \\
      --set data.dir=/root/gpu/data/squad --alt 'inb256=--set train.loss.lambda_inb=256.0'
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import pstats
import shlex
import signal
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # dpjax, when run as a script
STAGES = ("train", "chain", "hybrid", "step", "step_pallas", "dump_warm")
TEACHER_LOGITS = "teacher/logits"  # a --teacher candidate's logits, in its workdir
PROFILE_QUESTIONS = 2000  # the eval_profile stage's questions (the dev split's first)
# Issue 58's targets on an H100: (figure's key in "figures", comparison, target).
TARGETS = (("rc_exact_match", ">=", 60.0), ("top1", ">=", 65.0), ("em@1", ">=", 35.0),
           ("hybrid_em@1", ">=", 50.0), ("hybrid_top1", ">=", 85.0),
           ("step_ms", "<=", 20.0), ("dump_cold_tokens_per_s", ">=", 400e3),
           ("dump_warm_tokens_per_s", ">=", 1e6), ("eval_questions_per_s", ">=", 1000.0),
           ("step_mfu", ">=", 0.20))
OPEN_KEYS = ("questions", "em@1", "f1@1", "em@10", "top1", "top5", "top20", "mrr@20",
             "search_seconds", "search_split", "questions_per_sec_batch64", "index_tokens",
             "index_spec",
             "index_bytes_per_token", "model_step")
DUMP_KEYS = ("num_passages", "num_tokens", "num_windows", "encoded_tokens", "seconds",
             "compile_seconds", "compiles", "host_seconds", "processes", "width_multiple",
             "encoder_wait_seconds", "compile_ahead_seconds", "pipeline_wait_seconds",
             "write_wait_seconds", "dispatch_seconds", "fetch_seconds", "host_cpu_seconds")
# The parts of the training's wall (metrics.jsonl's "timing" record: `dpjax.training`), as
# `train_<part>_s` figures.
TRAIN_PARTS = ("data", "compiles", "steps", "rc_eval", "setup", "checkpoint", "validation")
# Peak dense bfloat16 tensor FLOP/s of one device, by a part of the name jax gives it
# (`device_kind`), the first that matches (NVIDIA's datasheets: docs/performance.md). NVL
# cards run at other clocks: not in the table, as every device not named (MFU None).
PEAK_BF16_FLOPS = (("NVL", None), ("H100 PCIe", 756e12), ("H100", 989.4e12),
                   ("H200", 989.4e12), ("A100", 312e12))


def parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="folder of the candidates' workdirs")
  parser.add_argument("--out", required=True, help="folder of gpu_check.json and the logs")
  parser.add_argument("--json", help="where gpu_check.json goes (default: in --out)")
  parser.add_argument("--config", default="experiments/squad.py")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="passed to every run.py command (e.g. data.dir)")
  parser.add_argument("--alt", action="append", default=[], metavar="NAME=ARGS",
                      help="a candidate trained and evaluated beside the default: run.py args")
  parser.add_argument("--teacher", action="append", default=[], metavar="NAME",
                      help="a candidate (default or an --alt) distilled: the train stage "
                           "first trains its cross-encoder teacher (`run.py teacher`)")
  parser.add_argument("--stages", nargs="+", default=list(STAGES),
                      choices=[*STAGES, "flash_tests", "eval_profile"])
  parser.add_argument("--deadline", type=float, default=520.0,
                      help="seconds for all stages; each stage's limit is cut to what is left")
  parser.add_argument("--step-args", default="--batch 48 --steps 20 --warmup 3",
                      help="train_step.py's arguments (the tiny test uses smaller ones)")
  parser.add_argument("--python", default=sys.executable)
  return parser.parse_args(argv)


class Check:
  """The runs, their limits and the report written after each stage."""

  def __init__(self, args, argv: list[str]):
    self.args = args
    self.root, self.out = pathlib.Path(args.workdir), pathlib.Path(args.out)
    self.candidates = {"default": []}
    for alt in args.alt:
      name, _, rest = alt.partition("=")
      if not name or name == "default" or not rest:
        raise SystemExit(f"gpu_check.py: --alt {alt!r}: expected NAME=RUN.PY ARGS")
      self.candidates[name] = shlex.split(rest)
    unknown = set(args.teacher) - set(self.candidates)
    if unknown:
      raise SystemExit(f"gpu_check.py: --teacher {sorted(unknown)}: not a candidate's name")
    self.teachers = {name: list(self.candidates[name]) for name in args.teacher}
    for name in self.teachers:  # trained on its teacher's logits; the teacher itself without
      self.candidates[name] += ["--set", f"train.teacher_logits={TEACHER_LOGITS}"]
    self.configs = {n: _resolved(args.config, [*args.set, *_sets(a)])
                    for n, a in self.candidates.items()}
    models = {n: _model_dims(args.config, [*args.set, *_sets(a)])
              for n, a in self.candidates.items()}
    # The device's copy of the tree may have no .git: DPJAX_COMMIT names the commit.
    commit = os.environ.get("DPJAX_COMMIT") or _git("rev-parse", "HEAD")
    device = _device(args.python)
    self.report = {"command": shlex.join(["python", "experiments/gpu_check.py", *argv]),
                   "commit": commit, "config": args.config,
                   "settings": args.set, "device": device, "peak": peak_flops(device),
                   "stages": {},
                   "candidates": {n: {"args": a, "recipe": self.configs[n], "model": models[n]}
                                  for n, a in self.candidates.items()},
                   "speed": {}, "autotuned_at_start": autotuned()}
    self.start = time.monotonic()  # the deadline counts the stages, not this set-up

  def left(self) -> float:
    return self.args.deadline - (time.monotonic() - self.start)

  def common(self, name: str, workdir: pathlib.Path | None = None,
             args: list[str] | None = None) -> list[str]:
    """run.py's arguments for candidate `name` (its own `args`, default its candidate's)."""
    return ["--config", self.args.config, "--workdir", str(workdir or self.root / name),
            "--set", "train.progress_bar=False",
            *(x for s in self.args.set for x in ("--set", s)),
            *(self.candidates[name] if args is None else args)]

  def launch(self, label: str, argv: list[str], env=None) -> tuple:
    log = (self.out / f"{label}.log").open("w")
    process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    return label, process, log, time.monotonic()

  def finish(self, launched: tuple, rc) -> dict:
    label, _, log, started = launched
    log.close()
    record = {"rc": rc, "wall_s": round(time.monotonic() - started, 2),
              "start_s": round(started - self.start, 2)}  # after the check's start
    self.report["stages"][label] = record
    return record

  def chains(self, jobs: dict, after) -> None:
    """Runs each name's jobs [(label, argv, env), ...] in turn, the names alongside each other;
    `after(name, label)` as each ends. A job that fails ends its name's chain; the deadline
    kills what still runs (rc "timeout")."""
    queues = {name: list(items) for name, items in jobs.items() if items}
    running = {name: self.launch(*queues[name].pop(0)) for name in queues}
    try:
      while running:
        for name, launched in list(running.items()):
          rc = launched[1].poll()
          if rc is None and self.left() > 0:
            continue
          if rc is None:
            _kill(launched[1])
            rc = "timeout"
          record = self.finish(launched, rc)
          del running[name]
          after(name, launched[0])
          self.save()
          if record["rc"] == 0 and queues[name] and self.left() > 1:
            running[name] = self.launch(*queues[name].pop(0))
        time.sleep(0.2)
    finally:  # whatever broke here, no stage goes on holding the accelerator
      for launched in running.values():
        _kill(launched[1])
        launched[2].close()

  def run(self, label: str, argv: list[str], env=None) -> dict:
    self.chains({label: [(label, argv, env)]}, lambda name, label: None)
    return self.report["stages"][label]

  def save(self):
    self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
    self.report["figures"] = figures(self.report)
    self.report["targets"] = targets(self.report["figures"])
    path = pathlib.Path(self.args.json or self.out / "gpu_check.json")
    path.with_suffix(".tmp").write_text(json.dumps(self.report, indent=1))
    path.with_suffix(".tmp").replace(path)


def autotuned() -> int | None:
  """How many fusions' autotuning results XLA finds in JAX's compilation cache (an earlier
  run's, which gpu_check.sh unpacks there: compiles skip their autotuning); None when the
  cache is off."""
  from dpjax.distributed import compilation_cache_folder
  folder = compilation_cache_folder()
  if folder is None:
    return None
  found = pathlib.Path(folder, "xla_gpu_per_fusion_autotune_cache_dir")
  return sum(1 for f in found.rglob("*") if f.is_file()) if found.is_dir() else 0


def _sets(argv: list[str]) -> list[str]:
  """The KEY=VALUE of each `--set` in run.py arguments."""
  return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]


RECIPE_KEYS = ("model.dtype", "data.max_seq_length", "data.max_query_length", "train.batch_size",
               "train.questions_per_window", "train.epochs", "train.num_steps",
               "train.learning_rate", "train.dropout", "train.loss.lambda_inb",
               "train.loss.prebatch_size", "train.teacher_logits", "train.loss.lambda_distill",
               "index.dump_dtype", "index.dump_min_context")


def _resolved(config: str, sets: list[str]) -> dict:
  """The recipe's settings as the run resolves them (RECIPE_KEYS)."""
  from dpjax.config import load_config
  resolved = load_config(config, sets)
  found = {}
  for key in RECIPE_KEYS:
    value = resolved
    for part in key.split("."):
      value = value.get(part) if value is not None else None
    found[key] = value
  return found


def _model_dims(config: str, sets: list[str]) -> dict | None:
  """The encoder's sizes the FLOPs need (`BertConfig` fields), from the config's random encoder
  or the pretrained model's config.json; None when the model is not found here."""
  from dpjax.config import load_config
  from dpjax.errors import CheckpointError
  from dpjax.model_files import resolve_model_dir
  model = load_config(config, sets).model
  keys = ("hidden_size", "num_hidden_layers", "intermediate_size")
  if model.init == "random":
    values = model.random.to_dict()
  else:
    try:
      values = json.loads((resolve_model_dir(model.name) / "config.json").read_text())
    except (CheckpointError, OSError, ValueError):
      return None
  return {k: values[k] for k in keys}


def encoder_flops(model: dict, rows: float, length: float, *, backward: bool = False,
                  first_only: bool = False) -> float:
  """Model FLOPs of a BERT encoder (`model`: `_model_dims`) over `rows` sequences of `length`
  tokens: 2 per multiply-add of the layers' matrix products (the query, key, value and output
  projections, the feed-forward pair, attention's scores and context), 3 times that with the
  backward pass; embeddings, LayerNorms, softmax and biases left out. With `first_only` the
  last layer computes every token's keys and values but the rest for the first row only (the
  question encoders' [CLS])."""
  d, ff, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
  projections = 2 * (4 * d * d + 2 * d * ff)  # one token through one layer's weights
  attention = 4 * d * length  # one query row's scores and context over `length` keys
  forward = (layers - 1 if first_only else layers) * length * (projections + attention)
  if first_only:
    forward += 4 * d * d * length + (projections - 4 * d * d) + attention
  return rows * forward * (3 if backward else 1)


def train_step_flops(model: dict, windows: float, length: float, questions: float,
                     query_length: float) -> float:
  """Model FLOPs of a training step: the phrase encoder forward and backward over `windows`
  windows of `length` tokens, the two question encoders ([CLS] only in their last layer) over
  `questions` of `query_length` tokens. The loss's question-token scores are left out."""
  return (encoder_flops(model, windows, length, backward=True)
          + 2 * encoder_flops(model, questions, query_length, backward=True, first_only=True))


def question_flops(model: dict, questions: float, length: float) -> float:
  """Model FLOPs of encoding `questions` of `length` tokens (the two question encoders)."""
  return 2 * encoder_flops(model, questions, length, first_only=True)


def peak_flops(device: str) -> dict:
  """The devices' bf16 peak for `_device`'s line ('platform kind count'): {"per_device" (FLOP/s,
  None when the table does not know the device), "devices", "note"}."""
  kind, _, count = device.rpartition(" ")
  per_device = next((peak for name, peak in PEAK_BF16_FLOPS if name.lower() in kind.lower()),
                    None)
  record = {"per_device": per_device, "devices": int(count) if count.isdigit() else 1}
  if per_device is None:
    record["note"] = f"no bf16 peak known for {kind or device!r}: MFU not computed"
  return record


def mfu(flops: float | None, seconds: float | None, peak: dict | None) -> float | None:
  """Model FLOPs utilisation: `flops` done in `seconds` over the devices' bf16 peak FLOP/s."""
  if not (flops and seconds and peak and peak.get("per_device")):
    return None
  return flops / seconds / (peak["per_device"] * peak["devices"])


def _kill(process: subprocess.Popen) -> None:
  """Kills a stage with its process group (a dump's tokenizing processes too) and reaps it."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  process.wait()


def targets(found: dict) -> list[dict]:
  """Each of TARGETS with the figure found for it and whether it is met (None: not measured)."""
  return [{"figure": key, "target": f"{op} {target:g}", "value": found.get(key),
           "met": _met(found.get(key), op, target)} for key, op, target in TARGETS]


def _met(value, op: str, target: float):
  if value is None:
    return None
  return value >= target if op == ">=" else value <= target


def _git(*args) -> str:
  result = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
  return result.stdout.strip() or "unknown"


def _device(python: str) -> str:
  code = "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind, len(jax.devices()))"
  result = subprocess.run([python, "-c", code], cwd=REPO, capture_output=True, text=True)
  return result.stdout.strip() or result.stderr.strip()[-300:]


def _json(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def read_train(workdir: pathlib.Path, batch_size: int) -> dict:
  """RC EM/F1 of results.json; the training's steps and median time per step over its logs;
  where its wall went (`train_<part>_s` of TRAIN_PARTS) and what its steps encoded, from the
  last "timing" record of a process that ran steps (else the last: a run found finished)."""
  found = {}
  results = _json(workdir / "results.json")
  if results:
    found.update({k: results.get(k) for k in ("rc_exact_match", "rc_f1", "count", "step")})
  records = []
  if (workdir / "metrics.jsonl").is_file():  # a line cut by a killed run is left out
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
      try:
        records.append(json.loads(line))
      except ValueError:
        continue
  rates = [r["examples_per_sec"] for r in records
           if r.get("split") == "train" and r.get("examples_per_sec")]
  if rates:  # examples_per_sec: steps/s x batch_size (windows, in passage-grouped batches)
    found["train_step_ms_median"] = 1e3 * batch_size / statistics.median(rates)
  steps = [r["step"] for r in records if r.get("split") == "train"]
  if steps:
    found["steps"] = max(steps)
  timings = [r for r in records if r.get("split") == "timing"]
  timing = ([r for r in timings if r.get("steps_run")] or timings or [None])[-1]
  if timing:
    found.update({f"train_{part}_s": timing.get(f"{part}_s", 0.0) for part in TRAIN_PARTS})
    found.update(train_compiles=timing.get("compiles"), train_steps_run=timing.get("steps_run"),
                 train_compiled_ahead=timing.get("compiled_ahead"),
                 train_rc_compiled_ahead=timing.get("rc_compiled_ahead"),
                 train_slowest_compiles=timing.get("slowest_compiles"),
                 train_encoded=timing.get("encoded", {}))
  return found


def read_dump(folder: pathlib.Path) -> dict:
  manifest = _json(folder / "manifest.json")
  if not manifest or not manifest.get("complete"):
    return {}
  found = {k: manifest.get(k) for k in DUMP_KEYS}
  if manifest.get("num_tokens") and manifest.get("seconds"):
    found["stored_tokens_per_s"] = manifest["num_tokens"] / manifest["seconds"]
  return found


def read_open(workdir: pathlib.Path, name: str = "open_eval_Flat.json") -> dict:
  report = _json(workdir / name)
  if not report:
    return {}
  found = {k: report.get(k) for k in OPEN_KEYS}
  if report.get("questions") and report.get("search_seconds"):
    found["questions_per_s"] = report["questions"] / report["search_seconds"]
  return found


def figures(report: dict) -> dict:
  """The default candidate's figures under the targets' names, from the report's records."""
  default = report["candidates"]["default"]
  found = {"autotuned_at_start": report.get("autotuned_at_start"),
           **default.get("train", {}), **default.get("open", {}),
           **{f"hybrid_{k}": v for k, v in default.get("hybrid", {}).items()}}
  stages = report["stages"]
  if default.get("dump", {}).get("stored_tokens_per_s"):
    found["dump_stored_tokens_per_s"] = default["dump"]["stored_tokens_per_s"]
  dump_stage = stages.get("default.dump", {})
  # The whole cold dump: the process's wall, its start and every compile included; a wall below
  # the manifest's encoding seconds is a run that found the dump complete (nothing encoded).
  if dump_stage.get("rc") == 0 and default.get("dump") and (
      dump_stage["wall_s"] > default["dump"]["seconds"]):
    found["dump_cold_tokens_per_s"] = default["dump"]["num_tokens"] / dump_stage["wall_s"]
  warm = report["speed"].get("dump_warm")
  if warm:
    found["dump_warm_tokens_per_s"] = warm["stored_tokens_per_s"]
  if "questions_per_s" in found:  # the questions answered over the eval's search time
    found["eval_questions_per_s"] = found["questions_per_s"]
    found["eval_alongside_hybrid"] = default.get("eval_alongside_hybrid", False)
    if stages.get("default.eval", {}).get("rc") == 0:  # its whole process: start, load, write
      found["eval_process_questions_per_s"] = found["questions"] / stages["default.eval"][
          "wall_s"]
  step = report["speed"].get("step")
  if step and "median_step_s" in step:
    found["step_ms"] = 1e3 * step["median_step_s"]
  pallas = report["speed"].get("step_pallas")
  if pallas and "median_step_s" in pallas:
    found["step_pallas_ms"] = 1e3 * pallas["median_step_s"]
  for stage, (flops, seconds) in stage_flops(report, found).items():
    found.update({f"{stage}_flops": flops, f"{stage}_flops_per_s": flops / seconds,
                  f"{stage}_mfu": mfu(flops, seconds, report.get("peak"))})
  return found


def stage_flops(report: dict, found: dict) -> dict:
  """{stage: (model FLOPs, seconds)} of the default candidate's timing stages: its training's
  steps (over their data and steps seconds), its dump (over the encoding's seconds; `dump_cold`
  over the process's wall) and the warm one, its evals' question encoding (over their search
  seconds, questions at data.max_query_length), the bf16 steps (over the median step)."""
  default, done = report["candidates"]["default"], {}
  for stage in ("step", "step_pallas"):
    step = report["speed"].get(stage) or {}
    if step.get("median_step_s") and step.get("model"):
      done[stage] = (train_step_flops(step["model"], step["batch"], step["length"],
                                      step["questions"], step["query_length"]),
                     step["median_step_s"])
  model, recipe = default.get("model"), default.get("recipe", {})
  if not model:  # (the candidate's model was not found: no FLOPs of its stages)
    return done
  encoded = found.get("train_encoded") or {}
  seconds = found.get("train_data_s", 0.0) + found.get("train_steps_s", 0.0)
  if encoded.get("windows") and seconds > 0:
    questions = encoded.get("questions", 0)
    done["train"] = (train_step_flops(model, encoded["windows"],
                                      encoded["window_tokens"] / encoded["windows"], questions,
                                      encoded.get("question_tokens", 0) / max(questions, 1)),
                     seconds)
  for stage, dump in (("dump", default.get("dump")),
                      ("dump_warm", report["speed"].get("dump_warm"))):
    if dump and dump.get("num_windows") and dump.get("encoded_tokens") and dump.get("seconds"):
      windows = dump["num_windows"]  # the phrase encoder forward, at the windows' mean length
      flops = encoder_flops(model, windows, dump["encoded_tokens"] / windows)
      done[stage] = (flops, dump["seconds"])
      if stage == "dump" and "dump_cold_tokens_per_s" in found:
        done["dump_cold"] = (flops, report["stages"]["default.dump"]["wall_s"])
  for stage, key in (("eval", "open"), ("hybrid_eval", "hybrid")):
    answered = default.get(key) or {}
    if (answered.get("questions") and answered.get("search_seconds")
        and recipe.get("data.max_query_length")):
      done[stage] = (question_flops(model, answered["questions"], recipe["data.max_query_length"]),
                     answered["search_seconds"])
  return done


def stage_train(check: Check):
  """Each candidate's training, the candidates alongside each other; a --teacher candidate's
  teacher first (`run.py teacher`: trained, its logits written), its RC EM/F1 reported."""
  def after(name, label):
    workdir = check.root / name
    if label.endswith(".teacher"):
      found = _json(workdir / "teacher" / "results.json") or {}
      check.report["candidates"][name]["teacher"] = {
          f"teacher_{k}": found.get(k) for k in ("rc_exact_match", "rc_f1", "step")}
    else:
      check.report["candidates"][name]["train"] = read_train(
          workdir, check.configs[name]["train.batch_size"])

  run = [check.args.python, "run.py"]
  jobs = {name: [(f"{name}.train", [*run, "train", *check.common(name)], None)]
          for name in check.candidates}
  for name, args in check.teachers.items():  # (its args without train.teacher_logits)
    jobs[name].insert(0, (f"{name}.teacher", [*run, "teacher", *check.common(name, args=args)],
                          None))
  check.chains(jobs, after)


def stage_chain(check: Check):
  """Each trained candidate's dump and Flat index, then its dense eval and, when the hybrid
  stage is asked for too, its hybrid search alongside that eval (`_hybrid_jobs`): both are
  bound by the host, so the accelerator would otherwise sit idle through one of them."""
  after = _after_chain(check)
  run, dense = [check.args.python, "run.py"], ["--set", "index.sparse=False"]
  check.chains({name: [(f"{name}.dump", [*run, "dump", *check.common(name)], None),
                       (f"{name}.index", [*run, "index", *check.common(name), *dense,
                                          "--set", 'index.specs=["Flat"]'], None)]
                for name in _trained(check)}, after)
  indexed = [name for name in _trained(check)
             if check.report["stages"].get(f"{name}.index", {}).get("rc") == 0]
  alongside = "hybrid" in check.args.stages
  env = _shared_memory(2) if alongside else None
  jobs = {name: [(f"{name}.eval", [*run, "eval", *check.common(name), *dense,
                                   "--set", "index.search_index=Flat"], env)]
          for name in indexed}
  for name in indexed:  # the eval's questions/s, measured sharing the host or not
    check.report["candidates"][name]["eval_alongside_hybrid"] = alongside
    if alongside:
      jobs[f"{name}+hybrid"] = _hybrid_jobs(check, name, env)
  check.chains(jobs, after)


def _shared_memory(processes: int) -> dict:
  """The environment of `processes` processes sharing the accelerator: each gets its share of
  the memory fraction this one was given (JAX preallocates it; its default 0.75)."""
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
  return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction / processes:.3f}"}


def stage_hybrid(check: Check):
  """Hybrid search for each candidate with a Flat index whose hybrid search the chain stage did
  not run already (`stage_chain`)."""
  check.chains({name: _hybrid_jobs(check, name, None) for name in _trained(check)
                if f"{name}.hybrid_index" not in check.report["stages"]}, _after_chain(check))


def _hybrid_jobs(check: Check, name: str, env) -> list[tuple]:
  """The candidate's hybrid search: the BM25 index, its weights chosen on training questions
  (`run.py index`), and the dev questions answered with it."""
  run, hybrid = [check.args.python, "run.py"], ["--set", "index.sparse=True"]
  return [(f"{name}.hybrid_index", [*run, "index", *check.common(name), *hybrid,
                                    "--set", "index.specs=[]"], env),
          (f"{name}.hybrid_eval", [*run, "eval", *check.common(name), *hybrid,
                                   "--set", "index.search_index=Flat"], env)]


def _after_chain(check: Check):
  """The `after` of the chain and hybrid jobs: a candidate's figures of each job that ends
  (labels "NAME.JOB")."""
  def after(_, label):
    name, _, job = label.rpartition(".")
    candidate, workdir = check.report["candidates"][name], check.root / name
    if job == "dump":
      candidate["dump"] = read_dump(workdir / "dump")
    elif job == "eval":
      candidate["open"] = read_open(workdir)
    elif job == "hybrid_eval":
      candidate["hybrid"] = read_open(workdir, "open_eval_Flat_hybrid.json")
  return after


def _trained(check: Check) -> list[str]:
  """The candidates whose training finished."""
  return [name for name in check.candidates if (check.root / name / "results.json").is_file()]


def stage_dump_warm(check: Check):
  check.run("dump_warm", [check.args.python, "run.py", "dump", *check.common("default"),
                          "--set", "index.dump_name=dump_warm"])
  check.report["speed"]["dump_warm"] = read_dump(check.root / "default" / "dump_warm")


def stage_eval_profile(check: Check):
  """The default's dense eval of its first PROFILE_QUESTIONS dev questions under cProfile (its
  main thread: search, rescoring, units, scores), in a workdir of links to the default's
  (checkpoints, dump; not its open_* files, which it leaves alone): the functions of most own
  and most cumulative time in the logs' eval_profile.txt, for where a question's host time
  goes (cProfile's overhead inflates Python's share)."""
  source, work = check.root / "default", check.root / "default_profile"
  work.mkdir(parents=True, exist_ok=True)
  for entry in source.iterdir():
    if not entry.name.startswith("open_") and not (work / entry.name).exists():
      (work / entry.name).symlink_to(entry.resolve())
  profile = check.out / "eval_profile.prof"
  record = check.run("eval_profile", [
      check.args.python, "-m", "cProfile", "-o", str(profile), "run.py", "eval",
      *check.common("default", work), "--set", "index.sparse=False",
      "--set", "index.search_index=Flat", "--set", f"eval.limit={PROFILE_QUESTIONS}"])
  if record["rc"] == 0 and profile.is_file():
    with (check.out / "eval_profile.txt").open("w") as out:
      for order in ("tottime", "cumulative"):
        pstats.Stats(str(profile), stream=out).sort_stats(order).print_stats(40)


def _step(check: Check, label: str, env=None):
  argv = [check.args.python, "experiments/benchmarks/train_step.py", "--framework", "jax",
          "--dtype", "bfloat16", *shlex.split(check.args.step_args)]
  record = check.run(label, argv, env)
  lines = [x for x in (check.out / f"{label}.log").read_text().splitlines() if x.startswith("{")]
  if record["rc"] == 0 and lines:
    found = json.loads(lines[-1])
    found.pop("all_step_s", None)
    check.report["speed"][label] = found


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  check = Check(args, argv)
  check.out.mkdir(parents=True, exist_ok=True)
  check.root.mkdir(parents=True, exist_ok=True)
  check.save()
  actions = {"train": stage_train, "chain": stage_chain, "hybrid": stage_hybrid,
             "dump_warm": stage_dump_warm, "eval_profile": stage_eval_profile,
             "step": lambda c: _step(c, "step"),
             "step_pallas": lambda c: _step(c, "step_pallas", {"DPJAX_ATTENTION": "pallas"}),
             "flash_tests": lambda c: c.run("flash_tests", [
                 args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/test_flash_attention.py"], {"JAX_PLATFORMS": "cuda",
                                                    "JAX_DEFAULT_MATMUL_PRECISION": "highest"})}
  for stage in args.stages:
    if check.left() <= 1:
      check.report["stages"][stage] = {"rc": "skipped: deadline"}
    else:
      actions[stage](check)
    check.save()
  print(json.dumps({"figures": check.report["figures"], "targets": check.report["targets"]},
                   indent=1))
  # 1 when a stage failed, timed out or was skipped: its figures are missing from the JSON.
  return 0 if all(r.get("rc") == 0 for r in check.report["stages"].values()) else 1


if __name__ == "__main__":
  sys.exit(main())


def merge(parts: list[dict]) -> dict:
  """One report of a check run in parts (a later command resuming the same workdirs): each
  stage's record from the first part that finished it (a later part finds its work done), the
  candidates' figures from the latest part that has them; the figures recomputed."""
  merged = json.loads(json.dumps(parts[0]))
  merged["parts"] = [{k: p.get(k) for k in ("command", "commit", "device", "elapsed_s")}
                     for p in parts]
  resumed = set()  # stages a later part finished after an earlier one was cut short
  for part in parts[1:]:
    for label, record in part["stages"].items():
      if merged["stages"].get(label, {}).get("rc") != 0:
        if label in merged["stages"] and record.get("rc") == 0:
          resumed.add(label)
        merged["stages"][label] = record
    for name, candidate in part["candidates"].items():
      merged["candidates"].setdefault(name, {}).update(
          {k: v for k, v in candidate.items() if v})
    merged["speed"].update(part.get("speed", {}))
  merged["figures"] = figures(merged)
  if "default.dump" in resumed:  # its seconds are the resumed part's, its tokens all parts'
    for key in ("dump_stored_tokens_per_s", "dump_cold_tokens_per_s", "dump_flops",
                "dump_flops_per_s", "dump_mfu", "dump_cold_flops", "dump_cold_flops_per_s",
                "dump_cold_mfu"):
      merged["figures"].pop(key, None)
    merged["dump_resumed"] = True
  merged["targets"] = targets(merged["figures"])
  return merged
