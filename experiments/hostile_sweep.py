"""A hostile sweep of dpjax's command line and API: bad configs, bad files, bad state.

Every case runs in its own process (a time limit catches hangs) against a small trained workdir
(`experiments/demo.py:tiny`: trained, dumped, indexed), and is classified:
  clean    the expected outcome: exit 2 with one error line naming the problem (CLI), a
           ValueError/ConfigError/DataError/DumpError with a message (API), or success with the
           bad records skipped and counted;
  traceback  a Python traceback for input a user could plausibly give;
  silent   a wrong result or data loss without an error (the case's own check fails);
  hang     the time limit was reached.

  python experiments/hostile_sweep.py --out results/reliability.json   # + results/reliability.md
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = ["--config", "experiments/demo.py:tiny"]
SQUAD_TINY = ["--config", "experiments/squad.py:tiny"]


def sh(*args, cwd=ROOT, timeout=120):
  start = time.perf_counter()
  try:
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - start
  except subprocess.TimeoutExpired:
    return None, "", time.perf_counter() - start


def cli(*args, timeout=180):
  return sh("run.py", *args, timeout=timeout)


def api(code: str, timeout=120):
  """A Python snippet; it prints OK or `ERROR <class>: <message>` for an expected error."""
  wrapped = ("import sys\nsys.path.insert(0, '.')\nfrom dpjax.errors import EXPECTED\n"
             "try:\n" + "".join(f"  {line}\n" for line in code.splitlines()) +
             "  print('OK')\nexcept (*EXPECTED, ValueError) as e:\n"
             "  print(f'ERROR {type(e).__name__}: {e}')\n")
  return sh("-c", wrapped, timeout=timeout)


class Sweep:
  def __init__(self, base: pathlib.Path, scratch: pathlib.Path):
    self.base, self.scratch, self.rows = base, scratch, []

  def workdir(self, name: str, trained: bool = True) -> pathlib.Path:
    """A fresh copy of the trained, dumped and indexed base workdir (or an empty one)."""
    path = self.scratch / name
    shutil.rmtree(path, ignore_errors=True)
    if trained:
      shutil.copytree(self.base, path)
    else:
      path.mkdir(parents=True)
    return path

  def case(self, area: str, what: str, outcome, expect: str = "error", must: str = "",
           check=None, command: str = ""):
    """Classifies (exit code, output, seconds). `expect`: 'error' (clean error naming `must`),
    'ok' (success; `must` in the output, e.g. a skip count)."""
    code, out, seconds = outcome
    last = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
    if code is None:
      verdict = "hang"
    elif "Traceback (most recent call last)" in out:
      verdict = "traceback"
    elif expect == "error":
      named = must in out
      clean = (code == 2 or "ERROR " in last[0]) and named
      verdict = "clean" if clean else "silent"
    else:
      verdict = "clean" if code == 0 and must in out and "ERROR " not in last[0] else "silent"
    if verdict == "clean" and check is not None and not check():
      verdict = "silent"
    message = next((line for line in reversed(out.splitlines())
                    if " ERROR " in line or line.startswith("ERROR ")), last[0])
    self.rows.append({"id": len(self.rows) + 1, "area": area, "case": what, "exit": code,
                      "verdict": verdict, "seconds": round(seconds, 1),
                      "message": message.split(" ERROR root: ")[-1][:160],
                      "command": command})
    print(f"{len(self.rows):3d} {verdict:9s} {area:8s} {what} -> {message[-110:]}", flush=True)


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


def config_cases(s: Sweep) -> None:
  w = str(s.workdir("config"))
  bad_py = s.scratch / "no_get_config.py"
  bad_py.write_text("X = 1\n")
  cases = [
      (["eval_rc", "--config", "experiments/nope.py"], "missing config file", "not found"),
      (["eval_rc", "--config", "experiments/demo.py:huge"], "unknown config arg", "huge"),
      (["eval_rc", "--config", str(bad_py)], "config without get_config", "get_config"),
      (["eval_rc", *TINY, "--set", "nope=1"], "--set unknown top-level key", "nope"),
      (["eval_rc", *TINY, "--set", "train.nope=1"], "--set unknown nested key", "train.nope"),
      (["eval_rc", *TINY, "--set", "eval.batch_size=abc"], "--set wrong type", "wrong type"),
      (["eval_rc", *TINY, "--set", "eval.batch_size"], "--set without =", "key=value"),
      (["train", *TINY, "--set", "train.batch_size=0"], "train.batch_size 0", "batch_size"),
      (["train", *TINY, "--set", "train.batch_size=-4"], "train.batch_size < 0", "batch_size"),
      (["train", *TINY, "--set", "train.batch_size=6"], "batch not a multiple of devices",
       None),  # 1 device here: allowed; checked below with forced devices
      (["search", *TINY, "--set", "index.top_k=0", "--query", "who?"], "index.top_k 0", "top_k"),
      (["search", *TINY, "--set", "index.top_k=-1", "--query", "who?"], "index.top_k < 0",
       "top_k"),
      (["eval", *TINY, "--set", "index.nprobe=-1"], "index.nprobe < 0", "nprobe"),
      (["index", *TINY, "--set", "index.train_size=0"], "index.train_size 0", "train_size"),
      (["eval", *TINY, "--set", "eval.batch_size=0"], "eval.batch_size 0", "eval.batch_size"),
      (["train", *TINY, "--set", "train.learning_rate=0"], "learning rate 0", "learning_rate"),
      (["train", *TINY, "--set", "train.learning_rate=-1e-4"], "negative learning rate",
       "learning_rate"),
      (["search", *TINY, "--set", "index.unit=word", "--query", "who?"], "unknown unit",
       "index.unit"),
      (["train", *TINY, "--set", "train.loss.recipe=magic"], "unknown loss recipe", "recipe"),
      (["eval", *TINY, "--set", "eval.checkpoint=newest"], "unknown eval.checkpoint",
       "eval.checkpoint"),
      (["train", *TINY, "--set", "data.max_seq_length=0"], "max_seq_length 0", "max_seq_length"),
      (["train", *TINY, "--set", "train.questions_per_window=0"], "questions_per_window 0",
       "questions_per_window"),
      (["train", *TINY, "--set", "train.num_steps=0", "--set", "train.epochs=0"],
       "nothing to train", "nothing to train"),
      (["train", *TINY, "--set", "train.questions_per_window=2", "--set",
        "train.loss.recipe=original"], "grouped batches with the original loss",
       "questions_per_window"),
      (["eval_rc", "--config", "experiments/demo.py", "--set", "model.name=/no/such/model"],
       "model directory missing", "/no/such/model"),
      (["eval_rc", *TINY, "--set", "model.init=magic"], "unknown model.init", "model.init"),
  ]
  for argv, what, must in cases:
    if must is None:
      continue
    s.case("config", what, cli(*argv, "--workdir", w), must=must,
           command="run.py " + " ".join(argv))
  s.case("cli", "unknown mode", cli("fly", *TINY, "--workdir", w), must="invalid choice",
         command="run.py fly ...")
  s.case("cli", "missing --workdir", cli("train", *TINY), must="--workdir",
         command="run.py train --config ...")
  s.case("cli", "--coordinator without the others", cli("data", *TINY, "--workdir", w,
         "--coordinator", "127.0.0.1:1"), must="go together")
  s.case("cli", "--process_id out of range", cli("data", *TINY, "--workdir", w, "--coordinator",
         "127.0.0.1:1", "--num_processes", "2", "--process_id", "5"), must="--process_id 5")
  s.case("cli", "coordinator never comes (3 s)", cli("data", *TINY, "--workdir", w,
         "--coordinator", "127.0.0.1:9", "--num_processes", "2", "--process_id", "1",
         "--init_timeout", "3"), must="could not join the job of coordinator 127.0.0.1:9")
  s.case("cli", "search without --query", cli("search", *TINY, "--workdir", w),
         must="--query")


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
      (SQUAD_TINY + ["--set", "data.dir=/no/such/dir"], "data.dir missing", "/no/such/dir"),
      (SQUAD_TINY + ["--set", "data.dir=" + variant("trunc", '{"data": [')],
       "truncated JSON", "invalid JSON"),
      (SQUAD_TINY + ["--set", f"data.dir={variant('empty', '')}"], "empty train file", "empty"),
      (SQUAD_TINY + ["--set", f"data.dir={variant('latin', bytes([0xff, 0xfe, 0x41]))}"],
       "train file not UTF-8", "UTF-8"),
      (SQUAD_TINY + ["--set", f"data.dir={variant('list', '[1, 2]')}"], "JSON but not SQuAD",
       "'data' list"),
      (SQUAD_TINY + ["--set", "data.dir=" + variant("allbad", json.dumps({"data": [
          {"title": "T", "paragraphs": [{"context": "x", "qas": [{"id": "1"}]}]}]}))],
       "no usable question", "no usable questions"),
  ]
  for argv, what, must in cases:
    s.case("data", what, cli("data", *argv, "--workdir", w), must=must,
           command="run.py data " + " ".join(argv[2:]))
  dup = variant("dup", json.dumps({"data": [{"title": "T", "paragraphs": [
      {"context": "Ann met Bob. " * 3, "qas": [qa, qa, {**qa, "id": "r"}]}]}]}))
  s.case("data", "duplicate question ids (skipped, counted)",
         cli("data", *SQUAD_TINY, "--workdir", w, "--set", f"data.dir={dup}"), expect="ok",
         must="duplicate question id")


def corpus_cases(s: Sweep) -> None:
  def corpus(name: str, text: str) -> str:
    path = s.scratch / name
    path.write_text(text, encoding="utf-8")
    return str(path)

  lines = [json.dumps({"id": f"c{i}", "title": "T", "text": f"Ann met Bob number {i} here."})
           for i in range(4)]
  cases = [
      ("bad JSONL lines (skipped, counted)", "\n".join(lines + ["{not json", "[1]"]), "ok",
       "invalid JSON line"),
      ("lone surrogate record (skipped, counted)",
       "\n".join(lines + ['{"id": "s", "title": "T", "text": "bad \\ud800 text"}']), "ok",
       "lone surrogate"),
      ("duplicate passage ids (skipped, counted)", "\n".join(lines + [lines[0]]), "ok",
       "duplicate passage id"),
      ("empty corpus", "", "error", "empty"),
      ("records without text only", '{"id": "x", "title": "T"}\n', "error", "empty"),
  ]
  for what, text, expect, must in cases:
    w = s.workdir("corpus")
    argv = ["dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=c", "--set",
            f"index.corpus=['{corpus(what[:8].replace(' ', '_') + '.jsonl', text)}']"]
    s.case("corpus", what, cli(*argv), expect=expect, must=must)
  w = s.workdir("corpus_missing")
  s.case("corpus", "corpus file missing", cli("dump", *TINY, "--workdir", str(w), "--set",
         "index.dump_name=c", "--set", "index.corpus=['/no/such/corpus.jsonl']"),
         must="/no/such/corpus.jsonl")
  for what, text, must in [
      ("questions JSONL with a bad line", '{"question": "Who?", "answers": ["Ann"]}\n{oops\n',
       "invalid JSON"),
      ("question without answers", '{"data": [{"id": "1", "question": "Who?"}]}', "answers"),
      ("duplicate open question ids",
       '{"data": [{"id": "1", "question": "Who?", "answers": ["A"]}, '
       '{"id": "1", "question": "Who else?", "answers": ["B"]}]}', "duplicate question id"),
  ]:
    w = s.workdir("questions")
    suffix = ".jsonl" if "JSONL" in what else ".json"
    s.case("questions", what, cli("eval", *TINY, "--workdir", str(w), "--set",
           f"index.questions={corpus('q' + str(len(s.rows)) + suffix, text)}"), must=must)
  w = s.workdir("questions_missing")
  s.case("questions", "questions file missing", cli("eval", *TINY, "--workdir", str(w), "--set",
         "index.questions=/no/such/q.json"), must="/no/such/q.json")



def state_cases(s: Sweep) -> None:
  empty = s.workdir("untrained", trained=False)
  s.case("state", "dump from a workdir without checkpoints (mistyped)",
         cli("dump", *TINY, "--workdir", str(empty)), must="no checkpoints",
         check=lambda: not (empty / "dump").exists())
  s.case("state", "search in a workdir without checkpoints",
         cli("search", *TINY, "--workdir", str(empty), "--query", "who?"), must="no checkpoints")
  w = s.workdir("nodump")
  shutil.rmtree(w / "dump")
  s.case("state", "eval without a dump", cli("eval", *TINY, "--workdir", str(w)),
         must="manifest.json")
  w = s.workdir("noindex")
  s.case("state", "eval of an index never built", cli("eval", *TINY, "--workdir", str(w),
         "--set", "index.search_index=IVF4_SQ8"), must="no index named")
  w = s.workdir("redump")
  other = s.scratch / "other_corpus.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")
  s.case("state", "complete dump rerun with another corpus", cli("dump", *TINY, "--workdir",
         str(w), "--set", f"index.corpus=['{other}']"), must="corpus")
  w = s.workdir("resumed_dump")
  small = ["--set", "index.shard_passages=5", "--set", "index.dump_name=d5"]
  cli("dump", *TINY, "--workdir", str(w), *small)
  manifest = json.loads((w / "d5" / "manifest.json").read_text())
  (w / "d5" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
  shutil.rmtree(w / "d5" / manifest["shards"][-1]["name"])  # killed before the last shard
  s.case("state", "interrupted dump resumed with another corpus", cli("dump", *TINY,
         "--workdir", str(w), *small, "--set", f"index.corpus=['{other}']"), must="corpus")
  w = s.workdir("foreign_index")
  shutil.rmtree(w / "dump" / "indexes")
  cli("dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2", "--set",
      f"index.corpus=['{other}']")
  shutil.copytree(s.base / "dump" / "indexes", w / "d2" / "indexes")
  s.case("state", "index of another dump of the same model", cli("eval", *TINY, "--workdir",
         str(w), "--set", "index.dump_name=d2"), must="another dump")
  w = s.workdir("manifest")
  (w / "dump" / "manifest.json").write_text('{"complete": tr')
  s.case("state", "truncated dump manifest", cli("eval", *TINY, "--workdir", str(w)),
         must="manifest.json: unreadable")
  w = s.workdir("shard")
  next((w / "dump").glob("shard_*/vectors.npy")).unlink()
  s.case("state", "a shard file deleted", cli("eval", *TINY, "--workdir", str(w)),
         must="missing or damaged")
  w = s.workdir("ckpt")
  latest = max((w / "checkpoints").glob("[0-9]*"), key=lambda p: int(p.name))
  for f in (latest / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 1000:
      f.write_bytes(b"\0" * 16)
  s.case("state", "damaged checkpoint files", cli("eval", *TINY, "--workdir", str(w)),
         must="cannot be restored")
  for what, setting, must in [("eval.checkpoint=best without validation", "eval.checkpoint=best",
                               "no best checkpoint"),
                              ("eval.checkpoint=qsft without QSFT", "eval.checkpoint=qsft",
                               "no qsft checkpoint")]:
    s.case("state", what, cli("eval", *TINY, "--workdir", str(s.workdir("which")), "--set",
           setting), must=must)
  s.case("state", "quantisation-aware QSFT on a Flat index", cli("qsft", *TINY, "--workdir",
         str(s.workdir("qsftq")), "--set", "qsft.quantized=True"), must="qsft.quantized")
  w = s.scratch / "a_file"
  w.write_text("not a directory")
  s.case("state", "--workdir is a file", cli("train", *TINY, "--workdir", str(w)),
         must=str(w))
  training_cases(s)


def training_cases(s: Sweep) -> None:
  w = s.workdir("lambda")
  s.case("train", "resume with a changed loss setting", cli("train", *TINY, "--workdir", str(w),
         "--set", "train.loss.lambda_inb=1.0"), must="lambda_inb")
  w = s.workdir("lock", trained=False)
  (w / "train.lock").write_text(str(os.getpid()))  # this (live) process holds it
  s.case("train", "a second training in the same workdir", cli("train", *TINY, "--workdir",
         str(w)), must="another training run", check=lambda: not (w / "checkpoints").exists())
  w = s.workdir("torn", trained=False)
  cli("train", *TINY, "--workdir", str(w), "--set", "train.stop_at_step=3")
  with (w / "metrics.jsonl").open("a") as f:
    f.write('{"step": 4, "spl')
  s.case("train", "torn last metrics line, then resume", cli("train", *TINY, "--workdir",
         str(w)), expect="ok", must="dev RC EM",
         check=lambda: all(json.loads(x) for x in (w / "metrics.jsonl").read_text().splitlines()))
  w = s.workdir("diverge", trained=False)
  s.case("train", "diverging training (lr 1e6)", cli("train", *TINY, "--workdir", str(w),
         "--set", "train.learning_rate=1e6", "--set", "train.warmup_steps=1", "--set",
         "train.freeze=[]", "--set", "train.checkpoint_every=1"), must="diverged",
         check=lambda: _no_checkpoint_after_divergence(w))
  data = [squad_files(s.scratch / f"sq{seed}", seed) for seed in (0, 1)]
  w = s.workdir("data_swap", trained=False)
  base = ["train", *SQUAD_TINY, "--workdir", str(w), "--set", "eval.limit=4"]
  cli(*base, "--set", f"data.dir={data[0]}", "--set", "train.stop_at_step=3", "--set",
      "train.checkpoint_every=3")
  s.case("train", "resume with other data under data.dir", cli(*base, "--set",
         f"data.dir={data[1]}", "--set", "train.checkpoint_every=3"), must="other data")


def audit_cases(s: Sweep) -> None:
  """The inputs and states the helpers' audits of 2026-11-27 found mishandled (each now has a
  test: DEFECT_TESTS)."""
  folder = squad_files(s.scratch / "squad_audit")
  w = str(s.workdir("audit_data", trained=False))
  for what, text, expect, must in [
      ("JSON nested past the recursion limit", "[" * 100000 + "]" * 100000, "error",
       "nested too deeply"),
      ("'qas' not a list (skipped, counted)", json.dumps({"data": [{"title": "T", "paragraphs": [
          {"context": "Ann met Bob.", "qas": {"id": "q", "question": "Who?", "answers": [
              {"text": "Ann", "answer_start": 0}]}},
          {"context": "Bob met Ann.", "qas": [{"id": "r", "question": "Who?", "answers": [
              {"text": "Bob", "answer_start": 0}]}]}]}]}), "ok", "'qas' is not a list")]:
    path = s.scratch / f"audit_{len(s.rows)}"
    shutil.copytree(folder, path)
    (path / "train-v1.1.json").write_text(text)
    s.case("data", what, cli("data", *SQUAD_TINY, "--workdir", w, "--set", f"data.dir={path}"),
           expect=expect, must=must)
  huge = s.scratch / "huge_int.jsonl"
  huge.write_text('{"id": "a", "title": "T", "text": "Ann met Bob."}\n{"id": "b", "n": '
                  + "9" * 5000 + "}\n")
  s.case("corpus", "a 5,000-digit integer in a JSONL line (skipped, counted)",
         cli("dump", *TINY, "--workdir", str(s.workdir("huge")), "--set", "index.dump_name=h",
             "--set", f"index.corpus=['{huge}']"), expect="ok", must="invalid JSON line")
  other = s.scratch / "audit_other.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")
  w = s.workdir("stale")
  s.case("state", "index over a dump of another corpus than index.corpus", cli(
      "index", *TINY, "--workdir", str(w), "--set", f"index.corpus=['{other}']"),
      must="is a dump of another corpus")
  s.case("state", "eval with other windows than the dump's", cli(
      "eval", *TINY, "--workdir", str(w), "--set", "data.doc_stride=20"),
      must="is a dump of other windows")
  w = s.workdir("head")
  np.savez(w / "filter_head.npz", kernel=np.zeros((30, 2), np.float32),
           bias=np.zeros(2, np.float32))
  s.case("state", "dump rerun after a filter head appeared", cli("dump", *TINY, "--workdir",
         str(w)), must="another token filter head")
  for spec, must in (("SQ8", "vectors, SQ8"), ("HNSW16", "vectors, HNSW16")):
    s.case("index", f"index.specs=['{spec}'] on the tiny dump", cli(
        "index", *TINY, "--workdir", str(s.workdir("spec")), "--set", f"index.specs=['{spec}']"),
        expect="ok", must=must)
  questions = s.scratch / "zero_width.jsonl"
  questions.write_text('{"id": "a", "question": "Who?", "answers": ["Ann"]}\n'
                       '{"id": "zw", "question": "\\u200b", "answers": ["Ann"]}\n')
  s.case("questions", "a question of only a zero-width space", cli(
      "eval", *TINY, "--workdir", str(s.workdir("zw")), "--set", f"index.questions={questions}"),
      must="hold no token, e.g. zw")


def _no_checkpoint_after_divergence(w: pathlib.Path) -> bool:
  records = [json.loads(x) for x in (w / "metrics.jsonl").read_text().splitlines()]
  good = max([r["step"] for r in records if r["split"] == "train"], default=0)
  return all(int(p.name) <= good for p in (w / "checkpoints").glob("[0-9]*"))


def api_cases(s: Sweep) -> None:
  base = str(s.base)
  index = f"from dpjax.index.search import PhraseIndex\nindex = PhraseIndex('{base}/dump', 'Flat')"
  searcher = ("from dpjax.config import load_config\nfrom dpjax.workdir import load_searcher\n"
              f"searcher, _ = load_searcher(load_config('experiments/demo.py:tiny'), '{base}')")
  cases = [
      ("PhraseIndex.search(k=0)", index + "\nimport numpy as np\nq = np.ones((1, 30), "
       "'float32')\nindex.search(q, q, 0)", "k (the number of results) must be >= 1"),
      ("PhraseIndex.search_phrases(k=-1)", index + "\nimport numpy as np\nq = np.ones((1, 30), "
       "'float32')\nindex.search_phrases(q, q, -1)", "must be >= 1"),
      ("PhraseIndex(nprobe=-1)", index.replace("'Flat')", "'Flat', nprobe=-1)"),
       "nprobe must be >= 1"),
      ("PhraseIndex of a missing index", index.replace("'Flat')", "'IVF9')"), "no index named"),
      ("DensePhrases.search([])", searcher + "\nsearcher.search([])", "no questions"),
      ("DensePhrases.search(unit='word')", searcher + "\nsearcher.search('who?', unit='word')",
       "unknown retrieval unit"),
      ("read_corpus of a missing file", "from dpjax.data.corpus import read_corpus\n"
       "list(read_corpus('/no/such.jsonl'))", "corpus file not found"),
      ("load_config with a bad override", "from dpjax.config import load_config\n"
       "load_config('experiments/demo.py', ['index.top_k=0'])", "index.top_k = 0"),
      ("read_questions of a JSON list", "import json, tempfile\nf = tempfile.NamedTemporaryFile("
       "'w', suffix='.json', delete=False)\nf.write('[1]')\nf.close()\nfrom dpjax.data.questions "
       "import read_questions\nread_questions(f.name)", "'data' list"),
      ("restore_model of an empty workdir", "import tempfile\nfrom dpjax.config import "
       "load_config\nfrom dpjax.workdir import restore_model\nrestore_model(load_config("
       "'experiments/demo.py:tiny'), tempfile.mkdtemp())", "no checkpoints"),
  ]
  for what, code, must in cases:
    s.case("api", what, api(code), must=must, command="python -c ...")


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
]


def render(results: dict, command: str) -> str:
  rows = results["cases"]
  counts = {v: sum(r["verdict"] == v for r in rows)
            for v in ("clean", "traceback", "silent", "hang")}
  lines = ["# Reliability: the hostile sweep", "",
           f"Command: `{command}` (one process per case, {results['seconds']:.0f} s in all, "
           f"commit {results['commit']}).", "",
           f"{len(rows)} cases: **{counts['clean']} clean** (a one-line error naming the field, "
           f"file, record or directory, or the bad records skipped and counted), "
           f"{counts['traceback']} tracebacks, {counts['silent']} silent wrong results or data "
           f"loss, {counts['hang']} hangs.", "",
           "Each case's own check is in `experiments/hostile_sweep.py`; the defects of the "
           "earlier sweep each have a test in `tests/test_reliability.py`.", "",
           "| # | area | case | exit | verdict | message (last error line) |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    message = r["message"].replace("|", "\\|")
    lines.append(f"| {r['id']} | {r['area']} | {r['case']} | {r['exit']} | {r['verdict']} | "
                 f"{message} |")
  lines += ["", "## The earlier sweep's defects and their tests (`tests/test_reliability.py`)", "",
            "| defect | test |", "|---|---|"]
  lines += [f"| {defect} | `{test}` |" for defect, test in DEFECT_TESTS]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/reliability.json")
  parser.add_argument("--keep", help="scratch folder to keep (default: a temporary one)")
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
  sweep = Sweep(base, scratch)
  for group in (config_cases, data_cases, corpus_cases, state_cases, api_cases, audit_cases):
    group(sweep)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  results = {"cases": sweep.rows, "seconds": time.perf_counter() - start, "commit": commit}
  save_results(args.out, results, render, "experiments/hostile_sweep.py", argv)
  if not args.keep:
    shutil.rmtree(scratch, ignore_errors=True)
  bad = [r for r in sweep.rows if r["verdict"] != "clean"]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
