"""A hostile sweep of dpjax's command line and API: bad configs, bad files, bad state.

Every case runs in its own process (a time limit catches hangs) against a small trained workdir
(`experiments/demo.py:tiny`: trained, dumped, indexed), and states what must be true of its result:
  error case  (CLI) exit status 2 with the error on the final line matching the case's pattern
              (naming the field, file, record or directory; a raw "[Errno N] ..." is not clean);
              (API) the expected exception class with a message matching the pattern;
  ok case     exit status 0, no ERROR on the final line, and the case's checks of what the run
              produced hold (the manifest's counts, the vectors indexed, a search's passages);
  and either way its extra checks hold (e.g. nothing left half-written, no checkpoint saved).
The words of a message alone never make a case clean. Each case is classified:
  clean      every statement above holds;
  traceback  a Python traceback for input a user could plausibly give;
  silent     a wrong result or data loss without an error (some statement fails);
  hang       the time limit was reached.

  python experiments/studies/hostile_sweep.py --out results/reliability.json  # + reliability.md
  python experiments/studies/hostile_sweep.py --out /tmp/r.json --only shard  # cases naming "shard"
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TINY = ["--config", "experiments/demo.py:tiny"]
SQUAD_TINY = ["--config", "experiments/squad.py:tiny"]
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
LOG_PREFIX = re.compile(r"^\S+ \S+ ERROR \S+: ")  # `2026-11-27 14:54:03,117 ERROR root: `
RAW_ERRNO = re.compile(r"^\[Errno \d+\]")


def sh(*args, cwd=ROOT, timeout=120, env=None):
  start = time.perf_counter()
  try:
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - start
  except subprocess.TimeoutExpired:
    return None, "", time.perf_counter() - start


def cli(*args, timeout=180, env=None):
  return sh("run.py", *args, timeout=timeout, env=env)


def api(code: str, timeout=120):
  """A Python snippet; it prints its own lines, then OK, or `ERROR <class>: <message>` for an
  expected error."""
  wrapped = ("import sys\nsys.path.insert(0, '.')\nfrom dpjax.errors import EXPECTED\n"
             "try:\n" + "".join(f"  {line}\n" for line in code.splitlines()) +
             "  print('OK')\nexcept (*EXPECTED, ValueError) as e:\n"
             "  print(f'ERROR {type(e).__name__}: {e}')\n")
  return sh("-c", wrapped, timeout=timeout)


def final_line(out: str) -> str:
  """The last non-empty line of the output, without the logging prefix."""
  lines = [line for line in out.strip().splitlines() if line.strip()]
  return LOG_PREFIX.sub("", lines[-1].strip()) if lines else ""


def half_written(path: pathlib.Path) -> list[str]:
  """Temporaries left under `path` (`x.tmp`, `.x.tmp<pid>`, Orbax's `*.orbax-checkpoint-tmp-*`)."""
  if not path.is_dir():
    return []
  return sorted(str(p.relative_to(path)) for p in path.rglob("*") if ".tmp" in p.name
                or "-tmp-" in p.name)


class Sweep:
  def __init__(self, base: pathlib.Path, scratch: pathlib.Path, only: str = ""):
    self.base, self.scratch, self.only, self.rows = base, scratch, only, []

  def flat_hits(self) -> list[tuple[str, str]]:
    """The top 3 (answer, title) of the exact (Flat) index for QUESTION, searched once."""
    if not hasattr(self, "_flat_hits"):
      code, out, _ = search_cli(self.workdir("flat_reference"), "--set", "index.top_k=3")()
      self._flat_hits = top_hits(out)
      if code != 0 or len(self._flat_hits) != 3:
        raise SystemExit(f"the reference search of the base workdir failed:\n{out[-2000:]}")
    return self._flat_hits

  def workdir(self, name: str, trained: bool = True) -> pathlib.Path:
    """A fresh copy of the trained, dumped and indexed base workdir (or an empty one)."""
    path = self.scratch / name
    shutil.rmtree(path, ignore_errors=True)
    if trained:
      shutil.copytree(self.base, path)
    else:
      path.mkdir(parents=True)
    return path

  def case(self, area: str, what: str, run, *, error: str | None = None,
           raises: tuple[str, str] | None = None, checks=(), clean_dir=None, command: str = ""):
    """Runs `run()` -> (exit code, output, seconds) and classifies it.

    Args:
      error: a CLI error case: exit 2 and the final line matches this regex.
      raises: an API case: (exception class, regex of its message) on the final line.
      checks: [(what is checked, a function of the output returning True when it holds)]; an
        ok case (neither `error` nor `raises`) needs at least one.
      clean_dir: a directory that must hold no temporaries afterwards (nothing half-written).
    """
    if self.only and self.only not in what:
      return
    if error is None and raises is None and not checks:
      raise ValueError(f"{what}: an ok case must check what the run produced")
    checks = list(checks)
    if clean_dir is not None:
      checks.append((f"nothing half-written in {pathlib.Path(clean_dir).name}/",
                     lambda out: not half_written(pathlib.Path(clean_dir))))
    code, out, seconds = run()
    last = final_line(out)
    if raises is not None:
      stated = [f"raises {raises[0]} matching `{raises[1]}`"]
      holds = (code == 0 and last.startswith(f"ERROR {raises[0]}: ")
               and re.search(raises[1], last) is not None)
    elif error is not None:
      stated = [f"exit 2, final line matches `{error}`"]
      holds = code == 2 and re.search(error, last) is not None and not RAW_ERRNO.match(last)
    else:
      stated, holds = ["exit 0"], code == 0 and not last.startswith("ERROR")
    failed = []
    if code is not None and "Traceback (most recent call last)" not in out:
      failed = [name for name, check in checks if not _holds(check, out)]
    stated += [name for name, _ in checks]
    if code is None:
      verdict = "hang"
    elif "Traceback (most recent call last)" in out:
      verdict = "traceback"
    else:
      verdict = "clean" if holds and not failed else "silent"
    self.rows.append({"id": len(self.rows) + 1, "area": area, "case": what, "exit": code,
                      "verdict": verdict, "seconds": round(seconds, 1), "message": last[:160],
                      "checked": "; ".join(stated), "checks_result": bool(stated),
                      "failed": failed, "command": command})
    print(f"{len(self.rows):3d} {verdict:9s} {area:8s} {what} -> {last[-110:]}"
          + (f" [failed: {'; '.join(failed)}]" if failed else ""), flush=True)


def _holds(check, out: str) -> bool:
  """A check's verdict; a check that raises (a file missing, unparsable) does not hold."""
  try:
    return bool(check(out))
  except Exception:  # noqa: BLE001  (any failure of a check is a failed check)
    return False


def chain(*runs):
  """Runs `runs` in order until one fails; (the last exit code, all output, all seconds)."""
  code, outs, seconds = 0, [], 0.0
  for run in runs:
    code, out, took = run()
    outs.append(out)
    seconds += took
    if code != 0:
      break
  return code, "\n".join(outs), seconds


def manifest_of(dump: pathlib.Path) -> dict:
  return json.loads((dump / "manifest.json").read_text())


def dump_holds(dump: pathlib.Path, ids: list[str], tokens: int | None = None):
  """A check: `dump` is complete and its shards hold exactly the passages `ids` (and `tokens`)."""
  def check(out):
    manifest = manifest_of(dump)
    stored = [json.loads(line)["id"] for shard in manifest["shards"]
              for line in (dump / shard["name"] / "passages.jsonl").read_text().splitlines()]
    return (manifest["complete"] and manifest["num_passages"] == len(ids) and stored == ids
            and (tokens is None or manifest["num_tokens"] == tokens))
  return (f"dump {dump.name}/ complete with passages {ids if len(ids) < 5 else len(ids)}"
          + ("" if tokens is None else f", {tokens} tokens"), check)


def printed(pattern: str, what: str | None = None):
  """A check: the output holds a line matching `pattern` (a count the program reports)."""
  return (what or f"output matches `{pattern}`",
          lambda out: re.search(pattern, out, re.M) is not None)


SEARCH_LINE = re.compile(r"^\s+\d+\. '(.*)' \((-?[\d.]+)\) — (.+?): (.*)$", re.M)
QUESTION = "Who was the sibling of Ne Chithashoum?"


def search_cli(w: pathlib.Path, *settings: str, query: str = QUESTION):
  return lambda: cli("search", *TINY, "--workdir", str(w), "--query", query, *settings)


def top_hits(out: str, n: int = 3) -> list[tuple[str, str]]:
  """The (answer, passage title) of the first n results a `run.py search` printed."""
  return [(m.group(1), m.group(3)) for m in SEARCH_LINE.finditer(out)][:n]


def index_checks(s: "Sweep", w: pathlib.Path, folder: str, resolved: str | None = None):
  """Checks of an index built by `run.py index` then searched: its vector count is the dump's
  token count, and its top 3 answers are those of the exact (Flat) index."""
  tokens = manifest_of(s.base / "dump")["num_tokens"]
  expected = s.flat_hits()

  def vectors(out):
    manifest = json.loads((w / "dump" / "indexes" / folder / "index_manifest.json").read_text())
    return manifest["num_tokens"] == tokens and (resolved is None
                                                  or manifest["resolved_spec"] == resolved)
  return [(f"index {folder} holds the dump's {tokens} vectors"
           + (f" as {resolved}" if resolved else ""), vectors),
          (f"its top 3 for {QUESTION!r} are the Flat index's {expected}",
           lambda out: top_hits(out) == expected)]


def prepare(base: pathlib.Path) -> None:
  for mode in ("train", "dump", "index"):
    code, out, _ = cli(mode, *TINY, "--workdir", str(base), timeout=600)
    if code != 0:
      raise SystemExit(f"preparing {base} ({mode}) failed:\n{out[-2000:]}")


def squad_files(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
  from dpjax.data.synthetic import write_synthetic
  files = write_synthetic(folder, seed=seed, num_train_entities=6, num_dev_entities=4,
                          questions_per_entity=3)
  files["train"].rename(folder / "train-v1.1.json")
  files["dev"].rename(folder / "dev-v1.1.json")
  return folder


MUST_BE = ": must be a number >= 1"
CONFIG_CASES = [  # (argv, case, pattern of the error)
    (["eval_rc", "--config", "experiments/nope.py"], "missing config file",
     r"config file not found: experiments/nope\.py"),
    (["eval_rc", "--config", "experiments/demo.py:huge"], "unknown config arg",
     r"unknown config arg 'huge'"),
    (["eval_rc", "--config", "BAD_PY"], "config without get_config",
     r"no_get_config\.py defines no get_config"),
    (["eval_rc", *TINY, "--set", "nope=1"], "--set unknown top-level key",
     r"^--set nope: no such config field"),
    (["eval_rc", *TINY, "--set", "train.nope=1"], "--set unknown nested key",
     r"^--set train\.nope: no such config field"),
    (["eval_rc", *TINY, "--set", "eval.batch_size=abc"], "--set wrong type",
     r"^--set eval\.batch_size=abc: wrong type for this field"),
    (["eval_rc", *TINY, "--set", "eval.batch_size"], "--set without =",
     r"^--set 'eval\.batch_size' is not of the form key=value"),
    (["train", *TINY, "--set", "train.batch_size=0"], "train.batch_size 0",
     r"^train\.batch_size = 0" + MUST_BE),
    (["train", *TINY, "--set", "train.batch_size=-4"], "train.batch_size < 0",
     r"^train\.batch_size = -4" + MUST_BE),
    (["search", *TINY, "--set", "index.top_k=0", "--query", "who?"], "index.top_k 0",
     r"^index\.top_k = 0" + MUST_BE),
    (["search", *TINY, "--set", "index.top_k=-1", "--query", "who?"], "index.top_k < 0",
     r"^index\.top_k = -1" + MUST_BE),
    (["eval", *TINY, "--set", "index.nprobe=-1"], "index.nprobe < 0",
     r"^index\.nprobe = -1" + MUST_BE),
    (["index", *TINY, "--set", "index.train_size=0"], "index.train_size 0",
     r"^index\.train_size = 0" + MUST_BE),
    (["eval", *TINY, "--set", "eval.batch_size=0"], "eval.batch_size 0",
     r"^eval\.batch_size = 0" + MUST_BE),
    (["train", *TINY, "--set", "train.learning_rate=0"], "learning rate 0",
     r"^train\.learning_rate = 0\.0: must be > 0"),
    (["train", *TINY, "--set", "train.learning_rate=-1e-4"], "negative learning rate",
     r"^train\.learning_rate = -0\.0001: must be > 0"),
    (["search", *TINY, "--set", "index.unit=word", "--query", "who?"], "unknown unit",
     r"^index\.unit = 'word': must be one of phrase, sentence, passage, document"),
    (["train", *TINY, "--set", "train.loss.recipe=magic"], "unknown loss recipe",
     r"^train\.loss\.recipe = 'magic': must be one of unified, original"),
    (["eval", *TINY, "--set", "eval.checkpoint=newest"], "unknown eval.checkpoint",
     r"^eval\.checkpoint = 'newest': must be one of latest, best, qsft"),
    (["train", *TINY, "--set", "data.max_seq_length=0"], "max_seq_length 0",
     r"^data\.max_seq_length = 0" + MUST_BE),
    (["train", *TINY, "--set", "train.questions_per_window=0"], "questions_per_window 0",
     r"^train\.questions_per_window = 0" + MUST_BE),
    (["train", *TINY, "--set", "train.num_steps=0", "--set", "train.epochs=0"],
     "nothing to train", r"^train\.num_steps and train\.epochs are both 0: nothing to train"),
    (["train", *TINY, "--set", "train.questions_per_window=2", "--set",
      "train.loss.recipe=original"], "grouped batches with the original loss",
     r"^train\.questions_per_window > 1 .* does not go with train\.loss\.recipe"),
    (["eval_rc", *TINY, "--set", "model.name=/no/such/model"],
     "model directory missing", r"^cannot resolve model '/no/such/model': not a local directory"),
    (["eval_rc", *TINY, "--set", "model.init=magic"], "unknown model.init",
     r"^unknown model\.init 'magic' \(pretrained or random\)"),
    (["search", "--config", "experiments/demo.py", "--query", "who?"],
     "a --config of another experiment than the workdir's",
     r"/config was made with another config \(experiments/demo\.py:tiny, .*dpjax_config\.json\): "
     r"model\.init 'random' \(--config experiments/demo\.py: 'pretrained'\).*leave --config out"),
    (["serve", *TINY, "--set", "serve.port=70000"], "serve.port out of range",
     r"serve\.port 70000: cannot listen there \(.*0-65535"),
]


def config_cases(s: Sweep) -> None:
  w = s.workdir("config")
  bad_py = s.scratch / "no_get_config.py"
  bad_py.write_text("X = 1\n")
  for argv, what, error in CONFIG_CASES:
    argv = [str(bad_py) if arg == "BAD_PY" else arg for arg in argv]
    s.case("config", what, lambda: cli(*argv, "--workdir", str(w)), error=error, clean_dir=w,
           command="run.py " + " ".join(argv))
  cpu8 = s.workdir("cpu8", trained=False)
  s.case("config", "batch not a multiple of devices (8 CPU devices)", lambda: cli(
      "train", *TINY, "--workdir", str(cpu8), "--set", "train.batch_size=6", env=EIGHT_DEVICES),
      error=r"^train\.batch_size 6 must be a multiple of the 8 devices",
      checks=[("no checkpoint written", lambda out: not (cpu8 / "checkpoints").exists())],
      command="XLA_FLAGS=--xla_force_host_platform_device_count=8 run.py train ... "
      "--set train.batch_size=6")
  cli_cases(s, w)


def cli_cases(s: Sweep, w: pathlib.Path) -> None:
  w = str(w)
  s.case("cli", "unknown mode", lambda: cli("fly", *TINY, "--workdir", w),
         error=r"argument mode: invalid choice: 'fly'", command="run.py fly ...")
  s.case("cli", "missing --workdir", lambda: cli("train", *TINY),
         error=r"the following arguments are required: --workdir",
         command="run.py train --config ...")
  s.case("cli", "--coordinator without the others", lambda: cli(
      "data", *TINY, "--workdir", w, "--coordinator", "127.0.0.1:1"),
      error=r"^--coordinator, --num_processes and --process_id go together")
  s.case("cli", "--process_id out of range", lambda: cli(
      "data", *TINY, "--workdir", w, "--coordinator", "127.0.0.1:1", "--num_processes", "2",
      "--process_id", "5"), error=r"^--process_id 5 must be in 0 \.\. 1")
  s.case("cli", "coordinator never comes (3 s)", lambda: cli(
      "data", *TINY, "--workdir", w, "--coordinator", "127.0.0.1:9", "--num_processes", "2",
      "--process_id", "1", "--init_timeout", "3"),
      error=r"^could not join the job of coordinator 127\.0\.0\.1:9 within 3 s")
  s.case("cli", "search without --query", lambda: cli("search", *TINY, "--workdir", w),
         error=r"^search needs one or more non-empty --query")
  passages = manifest_of(s.base / "dump")["num_passages"]
  s.case("cli", "search with top_k larger than the index (passages)", search_cli(
      s.workdir("bigk"), "--set", "index.top_k=5000", "--set", "index.unit=passage"),
      checks=[(f"all {passages} passages listed, each once",
               lambda out: len(SEARCH_LINE.findall(out)) == passages
               and len({m.group(3, 4) for m in SEARCH_LINE.finditer(out)})
               == passages)],
      command="run.py search ... --set index.top_k=5000 --set index.unit=passage")


def data_cases(s: Sweep) -> None:
  folder = squad_files(s.scratch / "squad_ok")
  w = str(s.workdir("data", trained=False))

  def variant(name: str, train_text: str | bytes) -> str:
    path = s.scratch / name
    shutil.copytree(folder, path, dirs_exist_ok=True)
    target = path / "train-v1.1.json"
    target.write_bytes(train_text if isinstance(train_text, bytes) else train_text.encode())
    return str(path)

  qa = {"id": "q", "question": "Who?", "answers": [{"text": "Ann", "answer_start": 0}]}
  cases = [
      (SQUAD_TINY + ["--set", "data.dir=/no/such/dir"], "data.dir missing",
       r"^/no/such/dir/train-v1\.1\.json: cannot read: No such file or directory"),
      (SQUAD_TINY + ["--set", "data.dir=" + variant("trunc", '{"data": [')],
       "truncated JSON", r"/trunc/train-v1\.1\.json: invalid JSON at line 1 column 11"),
      (SQUAD_TINY + ["--set", f"data.dir={variant('empty', '')}"], "empty train file",
       r"/empty/train-v1\.1\.json: file is empty$"),
      (SQUAD_TINY + ["--set", f"data.dir={variant('latin', bytes([0xff, 0xfe, 0x41]))}"],
       "train file not UTF-8", r"/latin/train-v1\.1\.json: not valid UTF-8 \(byte 0"),
      (SQUAD_TINY + ["--set", f"data.dir={variant('list', '[1, 2]')}"], "JSON but not SQuAD",
       r"/list/train-v1\.1\.json: expected a JSON object with a 'data' list"),
      (SQUAD_TINY + ["--set", "data.dir=" + variant("allbad", json.dumps({"data": [
          {"title": "T", "paragraphs": [{"context": "x", "qas": [{"id": "1"}]}]}]}))],
       "no usable question", r"/allbad/train-v1\.1\.json: no usable questions$"),
  ]
  for argv, what, error in cases:
    s.case("data", what, lambda: cli("data", *argv, "--workdir", w), error=error,
           command="run.py data " + " ".join(argv[2:]))
  dup = variant("dup", json.dumps({"data": [{"title": "T", "paragraphs": [
      {"context": "Ann met Bob. " * 3, "qas": [qa, qa, {**qa, "id": "r"}]}]}]}))
  s.case("data", "duplicate question ids (skipped, counted)",
         lambda: cli("data", *SQUAD_TINY, "--workdir", w, "--set", f"data.dir={dup}"),
         checks=[printed(r"^train: \S+: 3 questions read, 2 kept, 1 records skipped; 1 passages",
                         "train: 3 questions read, 2 kept, 1 skipped, 1 passage"),
                 printed(r"^\s+duplicate question id.*: 1 \(e\.g\.",
                         "the skip counted as a duplicate question id")])


def corpus_cases(s: Sweep) -> None:
  def corpus(name: str, text: str) -> str:
    path = s.scratch / name
    path.write_text(text, encoding="utf-8")
    return str(path)

  lines = [json.dumps({"id": f"c{i}", "title": "T", "text": f"Ann met Bob number {i} here."})
           for i in range(4)]
  good = [f"c{i}" for i in range(4)]
  cases = [
      ("bad JSONL lines (skipped, counted)", "\n".join(lines + ["{not json", "[1]"]), None,
       [printed(r"skipped 2 record\(s\)"), printed(r"^\s+invalid JSON line: 1 ")]),
      ("lone surrogate record (skipped, counted)",
       "\n".join(lines + ['{"id": "s", "title": "T", "text": "bad \\ud800 text"}']), None,
       [printed(r"skipped 1 record\(s\)"), printed(r"^\s+invalid Unicode .*: 1 ")]),
      ("duplicate passage ids (skipped, counted)", "\n".join(lines + [lines[0]]), None,
       [printed(r"skipped 1 record\(s\)")]),
      ("empty corpus", "", r"/corpus/c: the corpus is empty$", []),
      ("records without text only", '{"id": "x", "title": "T"}\n',
       r"/corpus/c: the corpus is empty$", [printed(r"skipped 1 record\(s\)")]),
  ]
  for what, text, error, checks in cases:
    w = s.workdir("corpus")
    argv = ["dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=c", "--set",
            f"index.corpus=['{corpus(what[:8].replace(' ', '_') + '.jsonl', text)}']"]
    if error is None:
      checks = [dump_holds(w / "c", good), *checks]
    s.case("corpus", what, lambda: cli(*argv), error=error, checks=checks, clean_dir=w)
  w = s.workdir("corpus_missing")
  s.case("corpus", "corpus file missing", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=c", "--set",
      "index.corpus=['/no/such/corpus.jsonl']"),
      error=r"^/no/such/corpus\.jsonl: corpus file not found",
      checks=[("no dump c/ written", lambda out: not (w / "c" / "manifest.json").exists())])
  w = s.workdir("tokenless")
  zero = corpus("tokenless.jsonl", '{"id": "a", "title": "", "text": "\\u200b"}\n')
  setting = ["--set", "index.dump_name=z", "--set", f"index.corpus=['{zero}']"]
  s.case("corpus", "index of a dump with 0 tokens", lambda: chain(
      lambda: cli("dump", *TINY, "--workdir", str(w), *setting),
      lambda: cli("index", *TINY, "--workdir", str(w), *setting)),
      error=r"/z: the dump holds no token \(1 passages", clean_dir=w,
      checks=[dump_holds(w / "z", ["a"], tokens=0),
              ("no index written", lambda out: not list((w / "z" / "indexes").glob("*")))])
  questions_cases(s, corpus)


def questions_cases(s: Sweep, write) -> None:
  for what, text, error in [
      ("questions JSONL with a bad line", '{"question": "Who?", "answers": ["Ann"]}\n{oops\n',
       r"q\d+\.jsonl:2: invalid JSON at column 2"),
      ("question without answers", '{"data": [{"id": "1", "question": "Who?"}]}',
       r"q\d+\.json: record 0 needs a non-empty 'question' and a non-empty 'answers' list"),
      ("duplicate open question ids",
       '{"data": [{"id": "1", "question": "Who?", "answers": ["A"]}, '
       '{"id": "1", "question": "Who else?", "answers": ["B"]}]}',
       r"q\d+\.json: record 1: duplicate question id '1'"),
      ("empty questions file", "", r"q\d+\.json: file is empty$"),
  ]:
    w = s.workdir("questions")
    suffix = ".jsonl" if "JSONL" in what else ".json"
    path = write("q" + str(len(s.rows)) + suffix, text)
    s.case("questions", what, lambda: cli("eval", *TINY, "--workdir", str(w), "--set",
           f"index.questions={path}"), error=error, clean_dir=w,
           checks=[("no open-domain results written",
                    lambda out: not list(w.glob("open_*")))])
  w = s.workdir("questions_missing")
  s.case("questions", "questions file missing", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "index.questions=/no/such/q.json"),
      error=r"^/no/such/q\.json: questions file not found")


def state_cases(s: Sweep) -> None:
  empty = s.workdir("untrained", trained=False)
  untrained = r"/untrained has no checkpoints: train into it first"
  s.case("state", "dump from a workdir without checkpoints (mistyped)",
         lambda: cli("dump", *TINY, "--workdir", str(empty)), error=untrained,
         checks=[("no dump written", lambda out: not (empty / "dump").exists())])
  s.case("state", "search in a workdir without checkpoints",
         lambda: cli("search", *TINY, "--workdir", str(empty), "--query", "who?"),
         error=untrained)
  w = s.workdir("nodump")
  shutil.rmtree(w / "dump")
  s.case("state", "eval without a dump", lambda: cli("eval", *TINY, "--workdir", str(w)),
         error=r"/nodump/dump: no manifest\.json: not a phrase dump")
  w = s.workdir("noindex")
  s.case("state", "eval of an index never built", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "index.search_index=IVF4_SQ8"),
      error=r"/indexes/IVF4_SQ8: no index named 'IVF4_SQ8' \(available: \['Flat'\]\)")
  other = s.scratch / "other_corpus.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")
  base_manifest = manifest_of(s.base / "dump")
  w = s.workdir("redump")
  s.case("state", "complete dump rerun with another corpus", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", f"index.corpus=['{other}']"),
      error=r"/redump/dump/shard_00000 holds other passages than the corpus gives now",
      clean_dir=w, checks=[("the old dump kept as it was",
                            lambda out: manifest_of(w / "dump") == base_manifest)])
  resumed_dump_case(s, other)
  w = s.workdir("foreign_index")
  shutil.rmtree(w / "dump" / "indexes")
  cli("dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2", "--set",
      f"index.corpus=['{other}']")
  shutil.copytree(s.base / "dump" / "indexes", w / "d2" / "indexes")
  s.case("state", "index of another dump of the same model", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2"),
      error=r"/foreign_index/d2/indexes/Flat was built from another dump than the one in")
  damaged_dump_cases(s)
  w = s.workdir("ckpt")
  latest = max((w / "checkpoints").glob("[0-9]*"), key=lambda p: int(p.name))
  for f in (latest / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 1000:
      f.write_bytes(b"\0" * 16)
  s.case("state", "damaged checkpoint files", lambda: cli("eval", *TINY, "--workdir", str(w)),
         error=rf"/ckpt/checkpoints/{latest.name}/state/\S+: \d+ bytes, \d+ when it was "
               rf"written: the checkpoint is damaged; delete .*/ckpt/checkpoints/{latest.name} ")
  for what, setting, error in [
      ("eval.checkpoint=best without validation", "eval.checkpoint=best",
       r"/which/checkpoints_best: no best checkpoint"),
      ("eval.checkpoint=qsft without QSFT", "eval.checkpoint=qsft",
       r"/which/checkpoints_qsft: no qsft checkpoint")]:
    s.case("state", what, lambda: cli("eval", *TINY, "--workdir", str(s.workdir("which")),
           "--set", setting), error=error)
  s.case("state", "quantisation-aware QSFT on a Flat index", lambda: cli(
      "qsft", *TINY, "--workdir", str(s.workdir("qsftq")), "--set", "qsft.quantized=True"),
      error=r"^qsft\.quantized: quantisation-aware QSFT needs an IVF index, not Flat")
  f = s.scratch / "a_file"
  f.write_text("not a directory")
  for what, workdir, error in [
      ("--workdir is a file", f, r"--workdir \S+/a_file is a file, not a directory"),
      ("--workdir under a file", f / "sub", r"--workdir \S+/a_file/sub lies under \S+/a_file, "
       "which is a file")]:
    s.case("state", what, lambda: cli("train", *TINY, "--workdir", str(workdir)), error=error,
           checks=[("the file left as it was", lambda out: f.read_text() == "not a directory")])
  training_cases(s)


def resumed_dump_case(s: Sweep, other: pathlib.Path) -> None:
  w = s.workdir("resumed_dump")
  small = ["--set", "index.shard_passages=5", "--set", "index.dump_name=d5"]
  cli("dump", *TINY, "--workdir", str(w), *small)
  manifest = json.loads((w / "d5" / "manifest.json").read_text())
  (w / "d5" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
  shutil.rmtree(w / "d5" / manifest["shards"][-1]["name"])  # killed before the last shard
  s.case("state", "interrupted dump resumed with another corpus", lambda: cli(
      "dump", *TINY, "--workdir", str(w), *small, "--set", f"index.corpus=['{other}']"),
      error=r"/resumed_dump/d5/shard_00000 holds other passages than the corpus gives now",
      clean_dir=w, checks=[("the dump still marked incomplete, no shard added", lambda out: (
          not manifest_of(w / "d5")["complete"]
          and len(list((w / "d5").glob("shard_*"))) == len(manifest["shards"]) - 1))])


def damaged_dump_cases(s: Sweep) -> None:
  """A dump damaged on disk (a copy cut short, a disk fault, a hand edit): eval names the file,
  by the sizes and checksums recorded when it was written, and says to dump again."""
  damaged = r"/dump/shard_00000/{}: {}: the dump is damaged; delete .*/dump/shard_00000"
  size = r"\d+ bytes, \d+ when it was written"

  def truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])

  def zero(path: pathlib.Path) -> None:
    path.write_bytes(b"\0" * path.stat().st_size)

  def miscount(path: pathlib.Path) -> None:
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "num_tokens": manifest["num_tokens"] + 5}))

  def cut(path: pathlib.Path) -> None:
    text = path.read_text()
    path.write_text(text[:text.index('"text": ') + 12])  # inside the first record

  def drop_last_records(path: pathlib.Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:len(lines) // 2]))  # whole records, half of them

  cases = [
      ("truncated dump manifest", "manifest.json", lambda p: p.write_text('{"complete": tr'),
       r"/dump/manifest\.json: unreadable \(JSONDecodeError: .*\); delete the dump"),
      ("a shard file deleted", "shard_00000/vectors.npy", pathlib.Path.unlink,
       damaged.format(r"vectors\.npy", "No such file or directory")),
      ("a shard file truncated", "shard_00000/vectors.npy", truncate,
       damaged.format(r"vectors\.npy", size)),
      ("a shard file zeroed", "shard_00000/vectors.npy", zero,
       damaged.format(r"vectors\.npy", r"its bytes differ from when it was written \(crc32\)")),
      ("a shard's passages.jsonl cut mid-record", "shard_00000/passages.jsonl", cut,
       damaged.format(r"passages\.jsonl", size)),
      ("a shard's passages.jsonl missing its last records", "shard_00000/passages.jsonl",
       drop_last_records, damaged.format(r"passages\.jsonl", size)),
      ("a dump missing a whole shard folder", "shard_00000", shutil.rmtree,
       damaged.format(r"\w+\.npy", "No such file or directory")),
      ("a manifest with wrong token counts", "manifest.json", miscount,
       r"/dump: shard contents do not match the manifest counts"),
  ]
  for what, name, damage, error in cases:
    w = s.workdir("damaged")
    damage(w / "dump" / name)
    s.case("state", what, lambda: cli("eval", *TINY, "--workdir", str(w)), error=error,
           checks=[("no open-domain results written", lambda out: not list(w.glob("open_*")))])


def lock_and_verify_cases(s: Sweep) -> None:
  """One writer a workdir (workdir.lock, as train.lock); `run.py verify` and eval against the
  digests recorded when the index and checkpoints were written."""
  w = s.workdir("held")
  (w / "workdir.lock").write_text(f"{os.getpid()} {socket.gethostname()} run.py dump --x")
  before = manifest_of(w / "dump")
  s.case("state", "a dump while another writer holds the workdir", lambda: cli(
      "dump", *TINY, "--workdir", str(w)),
      error=rf"/held/workdir\.lock: another run \(pid {os.getpid()}: run\.py dump --x\) is "
            "using this workdir",
      checks=[("the dump untouched", lambda out: manifest_of(w / "dump") == before)])
  s.case("state", "an index build while another writer holds the workdir", lambda: cli(
      "index", *TINY, "--workdir", str(w)),
      error=rf"/held/workdir\.lock: another run \(pid {os.getpid()}: run\.py dump --x\)")
  w = s.workdir("gone")
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  (w / "workdir.lock").write_text(f"{dead} {socket.gethostname()} run.py index")
  s.case("state", "an index build over a dead run's lock, then searched", lambda: chain(
      lambda: cli("index", *TINY, "--workdir", str(w)), search_cli(w, "--set", "index.top_k=3")),
      checks=[printed(rf"taking over the lock of a run that is gone \(pid {dead}",
                      "warned of the lock taken over"),
              ("the lock released", lambda out: not (w / "workdir.lock").exists()),
              *index_checks(s, w, "Flat")], clean_dir=w)
  w = s.workdir("sound")
  s.case("state", "verify of a sound workdir", lambda: cli("verify", *TINY, "--workdir", str(w)),
         checks=[printed(r"verify .*/sound: \d+ artifacts verified, 0 unverified, 0 damaged",
                         "every artifact verified, none unverified or damaged")])
  index = "dump/indexes/Flat/index.faiss"
  step = max((p for p in (s.base / "checkpoints").glob("[0-9]*")), key=lambda p: int(p.name))
  array = sorted((step / "state").rglob("d/*"), key=lambda p: p.stat().st_size)[-1]
  array = str(array.relative_to(s.base))
  named = r"/zeroed/{}: its bytes differ from when it was written \(crc32\)"
  cases = (("verify of a zeroed faiss index", index, "verify",
            r"/zeroed: 1 damaged artifacts: .*/zeroed/dump/indexes/Flat "),
           ("eval of a zeroed faiss index", index, "eval", named.format(re.escape(index))),
           ("verify of a zeroed checkpoint array", array, "verify",
            rf"/zeroed: 1 damaged artifacts: .*/zeroed/checkpoints/{step.name} "))
  for what, target, mode, error in cases:
    w = s.workdir("zeroed")
    path = w / target
    data = bytearray(path.read_bytes())
    data[len(data) // 4:len(data) // 4 + 4096] = bytes(min(4096, len(data) - len(data) // 4))
    path.write_bytes(bytes(data))
    s.case("state", what, lambda: cli(mode, *TINY, "--workdir", str(w)), error=error,
           checks=[printed(named.format(re.escape(target)), f"names {target}"),
                   ("no open-domain results written", lambda out: not list(w.glob("open_*")))])


def training_cases(s: Sweep) -> None:
  w = s.workdir("lambda")
  steps = sorted(int(p.name) for p in (w / "checkpoints").glob("[0-9]*"))
  s.case("train", "resume with a changed loss setting", lambda: cli(
      "train", *TINY, "--workdir", str(w), "--set", "train.loss.lambda_inb=1.0"),
      error=r"/lambda/checkpoints holds a run trained with other settings.*lambda_inb",
      checks=[("no checkpoint added", lambda out: steps == sorted(
          int(p.name) for p in (w / "checkpoints").glob("[0-9]*")))])
  w = s.workdir("lock", trained=False)
  (w / "train.lock").write_text(str(os.getpid()))  # this (live) process holds it
  s.case("train", "a second training in the same workdir", lambda: cli(
      "train", *TINY, "--workdir", str(w)),
      error=rf"/lock/train\.lock: another training run \(pid {os.getpid()}\) is using this",
      checks=[("no checkpoint written", lambda out: not (w / "checkpoints").exists())])
  w = s.workdir("torn", trained=False)
  cli("train", *TINY, "--workdir", str(w), "--set", "train.stop_at_step=3")
  with (w / "metrics.jsonl").open("a") as f:
    f.write('{"step": 4, "spl')
  last = max(steps)
  s.case("train", "torn last metrics line, then resume", lambda: cli(
      "train", *TINY, "--workdir", str(w)), clean_dir=w,
      checks=[("every metrics line parses", lambda out: all(
          json.loads(x) for x in (w / "metrics.jsonl").read_text().splitlines())),
              (f"trained on to step {last}: its checkpoint and train metrics", lambda out: (
                  (w / "checkpoints" / str(last)).is_dir() and any(
                      r["step"] == last and r["split"] == "train" for r in map(
                          json.loads, (w / "metrics.jsonl").read_text().splitlines())))),
              printed(r"dev RC EM", "the dev evaluation reported")])
  w = s.workdir("diverge", trained=False)
  s.case("train", "diverging training (lr 1e6)", lambda: cli(
      "train", *TINY, "--workdir", str(w), "--set", "train.learning_rate=1e6", "--set",
      "train.warmup_steps=1", "--set", "train.freeze=[]", "--set", "train.checkpoint_every=1"),
      error=r"^training diverged at step \d+: loss nan.*nothing was saved from this step on",
      checks=[("no checkpoint at or after the divergence",
               lambda out: _no_checkpoint_after_divergence(w))])
  data = [squad_files(s.scratch / f"sq{seed}", seed) for seed in (0, 1)]
  w = s.workdir("data_swap", trained=False)
  base = ["train", *SQUAD_TINY, "--workdir", str(w), "--set", "eval.limit=4"]
  cli(*base, "--set", f"data.dir={data[0]}", "--set", "train.stop_at_step=3", "--set",
      "train.checkpoint_every=3")
  s.case("train", "resume with other data under data.dir", lambda: cli(
      *base, "--set", f"data.dir={data[1]}", "--set", "train.checkpoint_every=3"),
      error=r"/data_swap/checkpoints holds a run trained on other data than the configured",
      checks=[("only the step-3 checkpoint", lambda out: sorted(
          p.name for p in (w / "checkpoints").glob("[0-9]*")) == ["3"])])


def audit_cases(s: Sweep) -> None:
  """The inputs and states the helpers' audits of 2026-11-27 found mishandled (each now has a
  test: DEFECT_TESTS)."""
  folder = squad_files(s.scratch / "squad_audit")
  w = str(s.workdir("audit_data", trained=False))
  for what, text, error, checks in [
      ("JSON nested past the recursion limit", "[" * 100000 + "]" * 100000,
       r"/audit_\d+/train-v1\.1\.json: invalid JSON: nested too deeply", []),
      ("'qas' not a list (skipped, counted)", json.dumps({"data": [{"title": "T", "paragraphs": [
          {"context": "Ann met Bob.", "qas": {"id": "q", "question": "Who?", "answers": [
              {"text": "Ann", "answer_start": 0}]}},
          {"context": "Bob met Ann.", "qas": [{"id": "r", "question": "Who?", "answers": [
              {"text": "Bob", "answer_start": 0}]}]}]}]}), None,
       [printed(r"^train: \S+: \d+ questions read, 1 kept, 1 records skipped; 2 passages",
                "train: 1 question kept, 1 record skipped, 2 passages"),
        printed(r"^\s+'qas' is not a list.*: 1 \(e\.g\.", "the skip counted as 'qas' not a list")]),
  ]:
    path = s.scratch / f"audit_{len(s.rows)}"
    shutil.rmtree(path, ignore_errors=True)  # a kept scratch folder of an earlier run
    shutil.copytree(folder, path)
    (path / "train-v1.1.json").write_text(text)
    s.case("data", what, lambda: cli("data", *SQUAD_TINY, "--workdir", w, "--set",
           f"data.dir={path}"), error=error, checks=checks)
  huge = s.scratch / "huge_int.jsonl"
  huge.write_text('{"id": "a", "title": "T", "text": "Ann met Bob."}\n{"id": "b", "n": '
                  + "9" * 5000 + "}\n")
  w = s.workdir("huge")
  s.case("corpus", "a 5,000-digit integer in a JSONL line (skipped, counted)", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=h", "--set",
      f"index.corpus=['{huge}']"), clean_dir=w,
      checks=[dump_holds(w / "h", ["a"]), printed(r"skipped 1 record\(s\)"),
              printed(r"^\s+invalid JSON line: 1 ")])
  other = s.scratch / "audit_other.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")
  w = s.workdir("stale")
  s.case("state", "index over a dump of another corpus than index.corpus", lambda: cli(
      "index", *TINY, "--workdir", str(w), "--set", f"index.corpus=['{other}']"),
      error=r"/stale/dump is a dump of another corpus", clean_dir=w)
  s.case("state", "eval with other windows than the dump's", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "data.doc_stride=20"),
      error=r"/stale/dump is a dump of other windows: doc_stride 48 \(the config's 20\)")
  w = s.workdir("head")
  np.savez(w / "filter_head.npz", kernel=np.zeros((30, 2), np.float32),
           bias=np.zeros(2, np.float32))
  s.case("state", "dump rerun after a filter head appeared", lambda: cli(
      "dump", *TINY, "--workdir", str(w)),
      error=r"/head/dump holds a dump made with another token filter head \(filter_head\.npz\)")
  spec_cases(s)
  questions = s.scratch / "zero_width.jsonl"
  questions.write_text('{"id": "a", "question": "Who?", "answers": ["Ann"]}\n'
                       '{"id": "zw", "question": "\\u200b", "answers": ["Ann"]}\n')
  s.case("questions", "a question of only a zero-width space", lambda: cli(
      "eval", *TINY, "--workdir", str(s.workdir("zw")), "--set", f"index.questions={questions}"),
      error=r"zero_width\.jsonl: 1 questions hold no token, e\.g\. zw")


def spec_cases(s: Sweep) -> None:
  """Index specs the tiny dump is too small for, built and then searched."""
  for spec, folder, resolved in (("SQ8", "SQ8", "SQ8"), ("HNSW16", "HNSW16", "HNSW16"),
                                 ("IVF4096,Flat", "IVF4096_Flat", None)):
    w = s.workdir("spec")
    s.case("index", f"index.specs=['{spec}'] on the tiny dump, then searched", lambda: chain(
        lambda: cli("index", *TINY, "--workdir", str(w), "--set", f"index.specs=['{spec}']"),
        search_cli(w, "--set", f"index.search_index={folder}", "--set", "index.top_k=3")),
        checks=index_checks(s, w, folder, resolved), clean_dir=w)


def _no_checkpoint_after_divergence(w: pathlib.Path) -> bool:
  records = [json.loads(x) for x in (w / "metrics.jsonl").read_text().splitlines()]
  good = max([r["step"] for r in records if r["split"] == "train"], default=0)
  return all(int(p.name) <= good for p in (w / "checkpoints").glob("[0-9]*"))


def api_cases(s: Sweep) -> None:
  base = str(s.base)
  index = (f"from dpjax.index.phrase_index import PhraseIndex\n"
           f"index = PhraseIndex('{base}/dump', 'Flat')")
  searcher = ("from dpjax.config import load_config\nfrom dpjax.workdir import load_searcher\n"
              f"searcher, _ = load_searcher(load_config('experiments/demo.py:tiny'), '{base}')")
  query = "\nimport numpy as np\nq = np.ones((1, 30), 'float32')\n"
  cases = [
      ("PhraseIndex.search(k=0)", index + query + "index.search(q, q, 0)",
       ("ValueError", r"k \(the number of results\) must be >= 1 \(an integer\), got 0$")),
      ("PhraseIndex.search_phrases(k=-1)", index + query + "index.search_phrases(q, q, -1)",
       ("ValueError", r"k \(the number of phrases\) must be >= 1 \(an integer\), got -1$")),
      ("PhraseIndex(nprobe=-1)", index.replace("'Flat')", "'Flat', nprobe=-1)"),
       ("ValueError", r"nprobe must be >= 1, got -1$")),
      ("PhraseIndex of a missing index", index.replace("'Flat')", "'IVF9')"),
       ("DumpError", r"/dump/indexes/IVF9: no index named 'IVF9' \(available: \['Flat'\]\)")),
      ("DensePhrases.search([])", searcher + "\nsearcher.search([])",
       ("ValueError", r"^ERROR ValueError: no questions to encode$")),
      ("DensePhrases.search(unit='word')", searcher + "\nsearcher.search('who?', unit='word')",
       ("ValueError", r"unknown retrieval unit 'word'")),
      ("read_corpus of a missing file", "from dpjax.data.corpus import read_corpus\n"
       "list(read_corpus('/no/such.jsonl'))", ("DataError", r"/no/such\.jsonl: corpus file not "
                                               "found$")),
      ("load_config with a bad override", "from dpjax.config import load_config\n"
       "load_config('experiments/demo.py', ['index.top_k=0'])",
       ("ConfigError", r"index\.top_k = 0: must be a number >= 1$")),
      ("read_questions of a JSON list", "import json, tempfile\nf = tempfile.NamedTemporaryFile("
       "'w', suffix='.json', delete=False)\nf.write('[1]')\nf.close()\nfrom dpjax.data.questions "
       "import read_questions\nread_questions(f.name)", ("DataError", r"\.json: expected a "
                                                          "'data' list$")),
      ("restore_model of an empty workdir", "import tempfile\nfrom dpjax.config import "
       "load_config\nfrom dpjax.workdir import restore_model\nrestore_model(load_config("
       "'experiments/demo.py:tiny'), tempfile.mkdtemp())",
       ("DataError", r"/tmp\w+ has no checkpoints: train into it first")),
  ]
  for what, code, raises in cases:
    s.case("api", what, lambda: api(code), raises=raises, command="python -c ...")
  passages = manifest_of(s.base / "dump")["num_passages"]
  s.case("api", "PhraseIndex.search with k larger than the index", lambda: api(
      index + query + "units = index.search(q, q, 10**6, unit='passage')[0]\n"
      "print('PASSAGES', len(units), len({key for _, key in units}), "
      "len(index.dump.passages))\nphrases = index.search_phrases(q, q, 10**6)[0]\n"
      "print('PHRASES', len(phrases), min(min(p.start_token, p.passage) for p in phrases), "
      "int(all(p.start_token <= p.end_token < index.num_vectors for p in phrases)))"),
      checks=[(f"all {passages} passages, each once", printed(
          rf"^PASSAGES {passages} {passages} {passages}$")[1]),
              ("search_phrases: some phrases, none with a padding id (-1) or past the index",
               printed(r"^PHRASES [1-9]\d* \d+ 1$")[1])],
      command="python -c ...")


# The defects of the earlier sweep (issue 25) and the test that failed before each fix.
DEFECT_TESTS = [
    ("a complete dump re-run with another corpus kept the old one",
     "test_complete_dump_refuses_another_corpus"),
    ("an interrupted dump resumed with a changed corpus mixed both",
     "test_resumed_dump_refuses_a_changed_corpus"),
    ("an index of another (or older) dump of the same model was accepted",
     "test_index_of_another_dump_is_refused"),
    ("resuming with data.dir at other data continued on it",
     "test_resume_refuses_other_training_data"),
    ("two trainings in one workdir crashed each other",
     "test_a_second_training_in_the_same_workdir_is_refused"),
    ("a torn last line of metrics.jsonl blocked any resume",
     "test_torn_last_metrics_line_does_not_block_resume"),
    ("diverging training finished with rc 0", "test_divergence_stops_before_a_checkpoint"),
    ("dumping from a mistyped workdir dumped untrained weights",
     "test_untrained_model_is_refused_unless_asked"),
    ("duplicate question ids dropped questions silently",
     "test_duplicate_question_ids_are_skipped_and_counted"),
    ("a lone surrogate killed the dump (tokenizer TypeError)",
     "test_lone_surrogate_record_is_skipped_and_counted"),
    ("top_k 0 / < 0, nprobe < 0: ZeroDivisionError, faiss asserts",
     "test_search_arguments_are_checked, test_bad_config_values_are_named"),
    ("batch_size 0, train_size <= 0 unchecked", "test_bad_config_values_are_named"),
    ("config errors, CheckpointError printed full stacks",
     "test_cli_errors_are_one_line_without_traceback"),
    ("faiss spec errors printed stacks; a failed build left indexes/*.tmp",
     "test_failed_index_build_is_a_config_error_and_leaves_no_temporary"),
    ("disk full during a dump named neither ENOSPC nor the path",
     "test_dump_write_error_names_the_shard_and_cause"),
    ("a read-only workdir failed eval (data/train.json rewritten)",
     "test_synthetic_data_is_not_rewritten"),
    ("a process whose coordinator never comes waited 5 min saying only Connecting",
     "test_coordinator_wait_times_out_with_its_address"),
    # 2026-11-27, the helpers' audits (the tests are in the files named)
    ("JSON nested too deeply or with a 5,000-digit integer: a traceback",
     "test_squad.py::test_json_that_python_refuses_beyond_syntax_is_a_data_error"),
    ("'qas' not a list: its questions dropped uncounted",
     "test_squad.py::test_qas_that_is_not_a_list_is_counted"),
    ("a dump resumed with another tokenizer or filter head mixed both",
     "test_resumed_dump_refuses_another_tokenizer_or_filter_head"),
    ("index / eval / search used a dump of another corpus or windows",
     "test_index_and_eval_refuse_a_dump_of_another_corpus_or_windows"),
    ("PQ / OPQ on a small corpus, SQ8 / HNSW specs, a full disk writing an index: tracebacks",
     "test_search.py::test_specs_small_or_without_ids_build_and_search"),
    ("a question of only a zero-width space was answered; a non-UTF-8 query string searched",
     "test_serve.py::test_search_arguments_numpy_k_strings_and_empty_questions"),
    ("Orbax's 'Metadata file does not exist' on every restore (2 API cases read as silent)",
     "test_a_checkpoint_of_another_model_is_refused"),
    # issue 61: cases that check what each run produced
    ("a --workdir that is (or lies under) a file: a bare '[Errno 17] File exists'",
     "test_a_workdir_that_is_a_file_is_named"),
    ("indexing a dump of 0 tokens blamed 'the filter threshold None'",
     "test_index_of_a_dump_without_tokens_says_so"),
    ("train.batch_size not a multiple of the devices: a sweep case skipped, untested",
     "test_batch_not_a_multiple_of_the_devices_is_refused"),
]


def render(results: dict, command: str) -> str:
  rows = results["cases"]
  counts = {v: sum(r["verdict"] == v for r in rows)
            for v in ("clean", "traceback", "silent", "hang")}
  checking = sum(bool(r.get("checks_result")) for r in rows)
  lines = ["# Reliability: the hostile sweep", "",
           f"Command: `{command}` (one process per case, {results['seconds']:.0f} s in all, "
           f"commit {results['commit']}).", "",
           f"{len(rows)} cases, **{checking} of them checking a result** (the column *checked*: "
           "exit status 2 and a pattern of the final line for an error, the exception class and "
           "message for an API call, and what the run produced: a dump's passages and counts, an "
           "index's vectors, a search's answers, no checkpoint or temporary left). "
           f"**{counts['clean']} clean**, {counts['traceback']} tracebacks, {counts['silent']} "
           f"silent wrong results or data loss, {counts['hang']} hangs.", "",
           "Each case's statements are in `experiments/studies/hostile_sweep.py`; the defects "
           "the sweeps found each have a test (below).", "",
           "| # | area | case | exit | verdict | checked | message (final line) |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    message, checked = (r[key].replace("|", "\\|") for key in ("message", "checked"))
    failed = f" **failed: {'; '.join(r['failed'])}**" if r.get("failed") else ""
    lines.append(f"| {r['id']} | {r['area']} | {r['case']} | {r['exit']} | {r['verdict']} | "
                 f"{checked}{failed} | {message} |")
  lines += ["", "## The sweeps' defects and their tests (`tests/test_reliability.py` unless "
            "named)", "", "| defect | test |", "|---|---|"]
  lines += [f"| {defect} | `{test}` |" for defect, test in DEFECT_TESTS]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/reliability.json")
  parser.add_argument("--keep", help="scratch folder to keep (default: a temporary one)")
  parser.add_argument("--only", default="", help="run only the cases whose name holds this")
  parser.add_argument("--render", metavar="COMMAND",
                      help="measure nothing: rewrite the Markdown of --out's JSON, stating COMMAND "
                      "as the command that measured it")
  args = parser.parse_args(argv)
  from experiments.report import save_results
  if args.render:
    from dpjax.io import write_text_atomic
    results = json.loads(pathlib.Path(args.out).read_text())
    write_text_atomic(pathlib.Path(args.out).with_suffix(".md"), render(results, args.render))
    return 0
  scratch = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="dpjax-sweep-"))
  scratch.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  base = scratch / "base"
  if not (base / "dump" / "indexes" / "Flat").is_dir():
    prepare(base)
  sweep = Sweep(base, scratch, args.only)
  for group in (config_cases, data_cases, corpus_cases, state_cases, lock_and_verify_cases,
                api_cases, audit_cases):
    group(sweep)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  results = {"cases": sweep.rows, "seconds": time.perf_counter() - start, "commit": commit}
  save_results(args.out, results, render, "experiments/studies/hostile_sweep.py", argv)
  if not args.keep:
    shutil.rmtree(scratch, ignore_errors=True)
  bad = [r for r in sweep.rows if r["verdict"] != "clean"]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
