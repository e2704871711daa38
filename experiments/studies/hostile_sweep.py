"""A hostile sweep of dpjax's command line and API: bad configs, bad files, bad state.

Every case runs in its own process (a time limit catches hangs) against a small trained workdir
(`experiments/demo.py:tiny`: trained, dumped, indexed). Each case records the checks it made, each
of one kind (`KINDS`), and whether it held:
  exit_status              the exit status: 2 for a refusal, 0 for a run (an API call exits 2 when
                           it raised an expected error, 0 when it returned);
  message                  the final line matches the case's pattern (naming the field, file,
                           record or directory; a raw "[Errno N] ..." does not), or a line the
                           program printed (a warning, a count of skipped records);
  artifacts_unchanged      sha256 of every file and the name of every folder under the case's
                           paths (its workdir, its input files), taken by this script before the
                           run and after, are equal (ALLOWED_CHANGES and a case's own named
                           exceptions aside): every refusal makes this check;
  artifact_vs_expectation  what the run produced against an expectation computed apart from it:
                           a clean run on the same input (a search's answers, a dump's arrays, an
                           uninterrupted training's losses) or counts recomputed from the input
                           files; every case that runs (exit 0) makes this check.
A case is classified:
  clean      every check it made held;
  traceback  a Python traceback for input a user could plausibly give;
  silent     a check failed: a wrong result, a changed artifact or a wrong message, without a
             traceback;
  hang       the time limit was reached.

  python experiments/studies/hostile_sweep.py                     # results/reliability.{json,md}
  python experiments/studies/hostile_sweep.py --subset fast --out /tmp/r.json   # minutes
  python experiments/studies/hostile_sweep.py --dry                # the cases and their checks
  python experiments/studies/hostile_sweep.py --out /tmp/r.json --only shard  # names with "shard"
"""
from __future__ import annotations

import argparse
import hashlib
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
from typing import Callable, NamedTuple, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TINY = ["--config", "experiments/demo.py:tiny"]
SQUAD_TINY = ["--config", "experiments/squad.py:tiny"]
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
LOG_PREFIX = re.compile(r"^\S+ \S+ ERROR \S+: ")  # `2026-11-27 14:54:03,117 ERROR root: `
RAW_ERRNO = re.compile(r"^\[Errno \d+\]")
TRACEBACK = "Traceback (most recent call last)"

KINDS = {
    "exit_status": "the exit status: 2 for a refusal, 0 for a run",
    "message": "a refusal's final line matches its pattern (a run's is not an ERROR); lines "
               "printed (a warning, a count) match theirs",
    "artifacts_unchanged": "sha256 of every file under the case's paths equal before and after",
    "artifact_vs_expectation": "what the run produced equals an expectation computed apart from "
                               "it (a clean run, the input files)",
}
# Files any run may write beside the artifacts it reads, by name; artifacts_unchanged ignores them.
ALLOWED_CHANGES = {
    ".dpjax_verified.json": "verified stamps: which files a check read in full, by their size, "
                            "times and inode (a cache of checks, rewritten by any reading run; a "
                            "copied workdir has new inodes)",
}
# The cases of `--subset fast` (one or more of each area and check kind; a few minutes on one
# core): tests/test_hostile_sweep.py runs them in `make test`. The torn-metrics resume, the
# longest (two trainings), runs in the full sweep only: the test stays under the suite's bound.
FAST = frozenset({
    "missing config file", "--set unknown nested key", "train.batch_size 0",
    "a --config of another experiment than the workdir's", "unknown mode", "missing --workdir",
    "search with top_k larger than the index (passages)", "truncated JSON",
    "duplicate question ids (skipped, counted)", "bad JSONL lines (skipped, counted)",
    "index of a dump with 0 tokens", "questions JSONL with a bad line",
    "complete dump rerun with another corpus", "a shard file zeroed", "damaged checkpoint files",
    "a dump while another writer holds the workdir", "verify of a sound workdir",
    "verify of a zeroed checkpoint array", "resume with a changed loss setting",
    "PhraseIndex.search(k=0)",
    "restore_model of an empty workdir", "PhraseIndex.search with k larger than the index",
    "index.specs=['SQ8'] on the tiny dump, then searched", "'qas' not a list (skipped, counted)",
    "empty corpus", "interrupted dump resumed with another corpus",
})


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
  """A Python snippet: it prints its own lines, then OK (exit 0), or `ERROR <class>: <message>`
  for an expected error (exit 2); any other error is a traceback (exit 1)."""
  wrapped = ("import sys\nsys.path.insert(0, '.')\nfrom dpjax.errors import EXPECTED\n"
             "try:\n" + "".join(f"  {line}\n" for line in code.splitlines()) +
             "  print('OK')\nexcept (*EXPECTED, ValueError) as e:\n"
             "  print(f'ERROR {type(e).__name__}: {e}')\n  sys.exit(2)\n")
  return sh("-c", wrapped, timeout=timeout)


def final_line(out: str) -> str:
  """The last non-empty line of the output, without the logging prefix."""
  lines = [line for line in out.strip().splitlines() if line.strip()]
  return LOG_PREFIX.sub("", lines[-1].strip()) if lines else ""


def logged_error(out: str) -> bool:
  """Whether the output's last non-empty line is a logged ERROR (`final_line` strips the
  prefix that says so) or an API call's "ERROR <class>: ..." line."""
  lines = [line.strip() for line in out.strip().splitlines() if line.strip()]
  return bool(lines) and (LOG_PREFIX.match(lines[-1]) is not None
                          or lines[-1].startswith("ERROR "))


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


def _sha256(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def artifact_digests(paths: Sequence[pathlib.Path]) -> dict[str, str]:
  """{path: sha256 of its bytes} of every file under `paths` (a file or a folder each), with
  "folder" for each folder and "absent" for a path that does not exist; keys are each path
  under its root, named by the root's own name (`workdir/dump/manifest.json`)."""
  digests = {}
  for root in map(pathlib.Path, paths):
    if not root.exists():
      digests[root.name] = "absent"
    elif not root.is_dir():
      digests[root.name] = _sha256(root)
    else:
      digests[root.name] = "folder"
      for path in sorted(root.rglob("*")):
        name = f"{root.name}/{path.relative_to(root).as_posix()}"
        digests[name] = "folder" if path.is_dir() else _sha256(path)
  return digests


def changed_paths(before: dict[str, str], after: dict[str, str],
                  allowed: Sequence[str] = ()) -> list[str]:
  """The paths added, removed or changed from `before` to `after`, except files named in
  ALLOWED_CHANGES and paths matching a regex of `allowed`."""
  return [f"{name} ({before.get(name, 'absent')[:8]} -> {after.get(name, 'absent')[:8]})"
          for name in sorted(set(before) | set(after))
          if before.get(name) != after.get(name)
          and name.rpartition("/")[2] not in ALLOWED_CHANGES
          and not any(re.search(pattern, name) for pattern in allowed)]


class Outcome(NamedTuple):
  """What a case's run gave: its exit status (None: timed out), output, final line, and the
  paths its run changed (`changed_paths`)."""
  code: int | None
  out: str
  last: str
  changed: list[str]


class Check(NamedTuple):
  """One check a case makes: its kind (`KINDS`), what it states, and a function of the Outcome
  that is True when the statement holds."""
  kind: str
  what: str
  test: Callable[[Outcome], bool]

  def holds(self, outcome: Outcome) -> bool:
    """The check's verdict; a check that raises (a file missing, unparsable) does not hold."""
    try:
      return bool(self.test(outcome))
    except Exception:  # noqa: BLE001  (any failure of a check is a failed check)
      return False


class Sweep:
  """Runs the selected cases against copies of the base workdir; `rows` holds their results.

  Args:
    base: the trained, dumped and indexed workdir (`prepare`).
    scratch: where the cases' workdirs and input files go.
    only: run only the cases whose name holds this.
    subset: "all", or "fast" (the cases named in FAST).
    dry: run nothing: record each selected case with the checks it would make.
  """

  def __init__(self, base: pathlib.Path, scratch: pathlib.Path, only: str = "",
               subset: str = "all", dry: bool = False):
    self.base, self.scratch, self.only, self.subset, self.dry = base, scratch, only, subset, dry
    self.rows, self._references, self._made = [], {}, set()

  def wants(self, what: str) -> bool:
    return (not self.only or self.only in what) and (self.subset == "all" or what in FAST)

  def workdir(self, name: str, trained: bool = True, keep: bool = False) -> pathlib.Path:
    """A fresh copy of the trained, dumped and indexed base workdir (or an empty one); with
    `keep`, one this sweep made earlier under this name is reused."""
    path = self.scratch / name
    if keep and name in self._made:
      return path
    self._made.add(name)
    shutil.rmtree(path, ignore_errors=True)
    if trained:
      shutil.copytree(self.base, path)
    else:
      path.mkdir(parents=True)
    return path

  def make(self, name: str, trained: bool = True, keep: bool = False, then=None):
    """A case's setup: makes the workdir `name` (`workdir`), then calls `then()` if given; it
    returns what `then` returns when that is a run's (exit code, output, seconds)."""
    def setup():
      self.workdir(name, trained, keep)
      done = then() if then is not None else None
      return done if isinstance(done, tuple) else None
    return setup

  def flat_hits(self) -> list[tuple[str, str]]:
    """The top 3 (answer, title) of the exact (Flat) index for QUESTION: a clean search of a
    copy of the base workdir, run once."""
    if "flat" not in self._references:
      code, out, _ = search_cli(self.workdir("flat_reference"), "--set", "index.top_k=3")()
      self._references["flat"] = top_hits(out)
      if code != 0 or len(self._references["flat"]) != 3:
        raise SystemExit(f"the reference search of the base workdir failed:\n{out[-2000:]}")
    return self._references["flat"]

  def clean_dump(self, corpus_text: str) -> pathlib.Path:
    """The dump (`c`, in a copy of the base workdir) of a clean corpus file holding
    `corpus_text`: what a dump of a corpus with these records and bad ones should equal."""
    key = hashlib.sha256(corpus_text.encode()).hexdigest()[:12]
    if key not in self._references:
      w = self.workdir(f"clean_{key}")
      corpus = self.scratch / f"clean_{key}.jsonl"
      corpus.write_text(corpus_text, encoding="utf-8")
      code, out, _ = cli("dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=c",
                         "--set", f"index.corpus=['{corpus}']")
      if code != 0:
        raise SystemExit(f"the reference dump of a clean corpus failed:\n{out[-2000:]}")
      self._references[key] = w / "c"
    return self._references[key]

  def case(self, area: str, what: str, run, *, error: str | None = None,
           raises: tuple[str, str] | None = None, unchanged: Sequence[pathlib.Path] = (),
           allowed: Sequence[str] = (), said=(), expect=(), setup=None, command: str = ""):
    """Runs `setup()`, then `run()` -> (exit code, output, seconds), and records its checks.

    Args:
      error: a CLI refusal: exit 2 and the final line matches this regex.
      raises: an API refusal: (exception class, regex of its message) on the final line.
      unchanged: paths (workdirs, input files) whose files must be the same after the run as
        before it (sha256 of each); a refusal needs at least one.
      allowed: regexes of paths (`workdir/metrics.jsonl`) the run may change all the same,
        besides ALLOWED_CHANGES.
      said: [(what, function of the output)]: lines the program printed (message checks).
      expect: [(what, function of the output)]: what the run produced against an expectation
        computed apart from it; a run (neither `error` nor `raises`) needs at least one.
      setup: makes the case's state (run only when the case is selected); it may return a run's
        (exit code, output, seconds), then checked to exit 0.
    """
    if not self.wants(what):
      return
    refusal = error is not None or raises is not None
    if refusal and not unchanged:
      raise ValueError(f"{what}: a refusal must check that its artifacts are unchanged")
    if not refusal and not expect:
      raise ValueError(f"{what}: a run must compare what it produced with an expectation")
    checks = case_checks(error, raises, unchanged, allowed, said, expect)
    if self.dry:
      self._record(area, what, refusal, [(c, None) for c in checks], None, 0.0, "", command)
      return
    start = time.perf_counter()
    prepared = setup() if setup is not None else None
    if prepared is not None:
      checks.insert(0, Check("exit_status", "its setup run exits 0",
                             lambda o, code=prepared[0]: code == 0))
    before = artifact_digests(unchanged)
    code, out, _ = run()
    changed = changed_paths(before, artifact_digests(unchanged), allowed) if unchanged else []
    outcome = Outcome(code, out, final_line(out), changed)
    self._record(area, what, refusal, [(c, c.holds(outcome)) for c in checks], outcome,
                 time.perf_counter() - start, (prepared or (0, ""))[1], command)

  def _record(self, area, what, refusal, results, outcome, seconds, setup_out, command):
    if outcome is None:
      verdict = "not run"
    elif outcome.code is None:
      verdict = "hang"
    elif TRACEBACK in outcome.out or TRACEBACK in setup_out:
      verdict = "traceback"
    else:
      verdict = "clean" if all(passed for _, passed in results) else "silent"
    failed = [c.what + (f": changed {', '.join(outcome.changed[:6])}"
                        if c.kind == "artifacts_unchanged" else "")
              for c, passed in results if passed is False]
    last = "" if outcome is None else outcome.last
    self.rows.append({
        "id": len(self.rows) + 1, "area": area, "case": what, "refusal": refusal,
        "exit": None if outcome is None else outcome.code, "verdict": verdict,
        "seconds": round(seconds, 1), "message": last[:160],
        "kinds": [k for k in KINDS if any(c.kind == k for c, _ in results)],
        "checks": [{"kind": c.kind, "what": c.what, "passed": passed} for c, passed in results],
        "failed": failed, "command": command})
    if outcome is not None:
      print(f"{len(self.rows):3d} {verdict:9s} {area:8s} {what} -> {last[-110:]}"
            + (f" [failed: {'; '.join(failed)}]" if failed else ""), flush=True)


def case_checks(error, raises, unchanged, allowed, said, expect) -> list[Check]:
  """The checks of a case (`Sweep.case`'s arguments), in the order of KINDS."""
  expected = 2 if error is not None or raises is not None else 0
  checks = [Check("exit_status", f"exit {expected}", lambda o: o.code == expected)]
  if raises is not None:
    checks.append(Check("message", f"final line: {raises[0]} matching `{raises[1]}`",
                        lambda o: o.last.startswith(f"ERROR {raises[0]}: ")
                        and re.search(raises[1], o.last) is not None))
  elif error is not None:
    checks.append(Check("message", f"final line matches `{error}`",
                        lambda o: re.search(error, o.last) is not None
                        and not RAW_ERRNO.match(o.last)))
  else:
    checks.append(Check("message", "final line not an ERROR",
                        lambda o: not logged_error(o.out)))
  checks += [Check("message", what, lambda o, f=f: f(o.out)) for what, f in said]
  if unchanged:
    names = ", ".join(pathlib.Path(p).name for p in unchanged)
    but = f" (but {', '.join(f'`{a}`' for a in allowed)})" if allowed else ""
    checks.append(Check("artifacts_unchanged", f"every file under {names} unchanged{but}",
                        lambda o: not o.changed))
  checks += [Check("artifact_vs_expectation", what, lambda o, f=f: f(o.out))
             for what, f in expect]
  return checks


def manifest_of(dump: pathlib.Path) -> dict:
  return json.loads((dump / "manifest.json").read_text())


def printed(pattern: str, what: str | None = None):
  """A message check: the output holds a line matching `pattern`."""
  return (what or f"output matches `{pattern}`",
          lambda out: re.search(pattern, out, re.M) is not None)


def shard_folders(dump: pathlib.Path) -> list[pathlib.Path]:
  """The dump's shard folders as found on disk (not as its manifest lists them)."""
  return sorted(p for p in dump.glob("shard_*") if p.is_dir() and not p.name.endswith(".tmp"))


def stored_passages(dump: pathlib.Path) -> list[tuple[str, str, str]]:
  """(id, title, text) of every passage the dump's shards hold, in shard order."""
  return [(r["id"], r["title"], r["text"]) for shard in shard_folders(dump)
          for r in map(json.loads, (shard / "passages.jsonl").read_text().splitlines())]


def stored_arrays(dump: pathlib.Path) -> dict[str, np.ndarray]:
  """Each array file of the dump's shards (`vectors.npy`, ...), the shards' rows concatenated."""
  shards = shard_folders(dump)
  names = sorted({p.name for shard in shards for p in shard.glob("*.npy")})
  return {name: np.concatenate([np.load(shard / name) for shard in shards]) for name in names}


def stored_vectors(dump: pathlib.Path) -> int:
  """The number of vectors (rows of `vectors.npy`) in the dump's shards."""
  return sum(np.load(shard / "vectors.npy", mmap_mode="r").shape[0]
             for shard in shard_folders(dump))


def dump_like(s: "Sweep", dump: pathlib.Path, clean_text: str, ids: list[str]):
  """An expectation: `dump` is complete and equals the dump of a clean corpus of `clean_text`
  (the records `ids`): the same passages, and every array (vectors, spans, filter logits) equal."""
  def check(out):
    reference = s.clean_dump(clean_text)
    ours, theirs = stored_arrays(dump), stored_arrays(reference)
    return (manifest_of(dump)["complete"] and [p[0] for p in stored_passages(dump)] == ids
            and stored_passages(dump) == stored_passages(reference) and ours.keys() == theirs.keys()
            and all(np.array_equal(ours[k], theirs[k]) for k in ours))
  return (f"dump {dump.name}/ holds passages {ids if len(ids) < 5 else len(ids)}, its arrays "
          "equal to a clean corpus's dump", check)


def corpus_paragraphs(path: pathlib.Path) -> list[tuple[str, str]]:
  """(title, context) of every paragraph of a SQuAD-format corpus file, read here."""
  return [(article["title"], paragraph["context"])
          for article in json.loads(path.read_text())["data"]
          for paragraph in article["paragraphs"]]


def every_passage_once(corpus: pathlib.Path, hits: list[tuple[str, str]]) -> bool:
  """Whether the (title, text shown) of `hits` are the corpus's paragraphs, each once (a
  shown text may be the start of the paragraph's)."""
  left = corpus_paragraphs(corpus)
  for title, text in hits:
    match = next((i for i, (t, c) in enumerate(left) if t == title and c.startswith(text)), None)
    if match is None:
      return False
    left.pop(match)
  return not left


def squad_counts(path: pathlib.Path) -> dict:
  """What `run.py data` should report of a SQuAD file, recomputed here from its JSON: a passage
  per paragraph; a question read per entry of a `qas` list (a `qas` that is not a list: one
  record read and skipped); kept if it has an id, a question and an answer text found in its
  context, and its id was not kept before; skipped otherwise."""
  read, skipped, passages, ids = 0, 0, 0, []
  for article in json.loads(path.read_text())["data"]:
    for paragraph in article["paragraphs"]:
      passages += 1
      qas = paragraph.get("qas", [])
      if not isinstance(qas, list):
        read, skipped = read + 1, skipped + 1
        continue
      for qa in qas:
        read += 1
        found = any(a["text"] and a["text"] in paragraph["context"] for a in qa.get("answers", []))
        if qa.get("id") is not None and qa.get("question") and found and qa["id"] not in ids:
          ids.append(qa["id"])
        else:
          skipped += 1
  return {"read": read, "kept": len(ids), "skipped": skipped, "passages": passages, "ids": ids}


DATA_LINE = re.compile(r"^(train|dev): (\S+): (\d+) questions read, (\d+) kept, (\d+) records "
                       r"skipped; (\d+) passages", re.M)


def data_as_recounted(folder: pathlib.Path):
  """An expectation of `run.py data` on the SQuAD files of `folder`: the counts it prints for
  train and dev, and the ids of the questions `read_squad` keeps, equal to `squad_counts`'s."""
  def check(out):
    from dpjax.data.squad import read_squad
    reported = {m.group(1): tuple(map(int, m.group(3, 4, 5, 6))) for m in DATA_LINE.finditer(out)}
    for split in ("train", "dev"):
      path = folder / f"{split}-v1.1.json"
      expected = squad_counts(path)
      kept = [q.id for q in read_squad(path)[1]]
      if (reported.get(split) != tuple(expected[k] for k in ("read", "kept", "skipped",
                                                              "passages"))
          or kept != expected["ids"]):
        return False
    return True
  return ("train and dev: questions read, kept, skipped, passages and the kept ids as "
          "recounted from the files", check)


SEARCH_LINE = re.compile(r"^\s+\d+\. '(.*)' \((-?[\d.]+)\) — (.+?): (.*)$", re.M)
QUESTION = "Who was the sibling of Ne Chithashoum?"


def search_cli(w: pathlib.Path, *settings: str, query: str = QUESTION):
  return lambda: cli("search", *TINY, "--workdir", str(w), "--query", query, *settings)


def top_hits(out: str, n: int = 3) -> list[tuple[str, str]]:
  """The (answer, passage title) of the first n results a `run.py search` printed."""
  return [(m.group(1), m.group(3)) for m in SEARCH_LINE.finditer(out)][:n]


def index_checks(s: "Sweep", w: pathlib.Path, folder: str, resolved: str | None = None):
  """Expectations of an index built by `run.py index` then searched: faiss reads back as many
  vectors as the dump's shards hold, and its top 3 answers are those of a clean search of the
  exact (Flat) index."""
  def vectors(out):
    import faiss
    index = w / "dump" / "indexes" / folder
    manifest = json.loads((index / "index_manifest.json").read_text())
    return (faiss.read_index(str(index / "index.faiss")).ntotal == stored_vectors(w / "dump")
            and (resolved is None or manifest["resolved_spec"] == resolved))
  return [(f"faiss reads {folder} back with the dump's vector count"
           + (f", built as {resolved}" if resolved else ""), vectors),
          (f"its top 3 for {QUESTION!r} are a clean Flat search's",
           lambda out: top_hits(out) == s.flat_hits())]


def checkpoint_steps(w: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in (w / "checkpoints").glob("[0-9]*"))


def metrics_records(w: pathlib.Path, split: str) -> list[dict]:
  return [r for r in map(json.loads, (w / "metrics.jsonl").read_text().splitlines())
          if r["split"] == split]


def file_stamps(folder: pathlib.Path) -> dict[str, tuple[str, int]]:
  """(sha256, mtime in ns) of every file under `folder`: a file written again, even with the
  same bytes, has another mtime."""
  return {str(p.relative_to(folder)): (_sha256(p), p.stat().st_mtime_ns)
          for p in sorted(folder.rglob("*")) if p.is_file()}


def workdir_artifacts(w: pathlib.Path) -> int:
  """The artifacts `run.py verify` should check in `w`, counted here from its folders: each
  checkpoint step, each shard of a dump (a folder with a manifest), each index folder of a dump
  and a token filter head."""
  steps = [p for kind in ("checkpoints", "checkpoints_best", "checkpoints_qsft")
           for p in (w / kind).glob("[0-9]*") if p.is_dir()]
  dumps = [p.parent for p in w.glob("*/manifest.json")]
  return (len(steps) + sum(len(shard_folders(d)) for d in dumps)
          + sum(1 for d in dumps for p in (d / "indexes").glob("*") if p.is_dir())
          + (w / "filter_head.npz").is_file())


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
    (["eval", *TINY, "--set", "index.reread=-1"], "index.reread < 0",
     r"^index\.reread = -1: must be a number >= 0"),
    (["eval", *TINY, "--set", "index.reread_margin=2.0"], "index.reread_margin without a count",
     r"^index\.reread_margin is set without index\.reread"),
    (["eval", *TINY, "--set", "index.reread=2", "--set", "index.reread_window=0"],
     "index.reread_window of no word piece", r"^index\.reread_window = 0: must be a number >= 1"),
    (["eval", *TINY, "--set", "index.reread_checkpoint=latest"],
     "index.reread_checkpoint without a count",
     r"^index\.reread_checkpoint is set without index\.reread"),
    (["eval", *TINY, "--set", "index.reread=2", "--set", "index.reread_checkpoint=newest"],
     "index.reread_checkpoint of no kind",
     r"^index\.reread_checkpoint = 'newest': must be one of latest, best, qsft"),
    (["serve", *TINY, "--set", "serve.port=70000"], "serve.port out of range",
     r"serve\.port 70000: cannot listen there \(.*0-65535"),
]


def config_cases(s: Sweep) -> None:
  w = s.scratch / "config"
  bad_py = s.scratch / "no_get_config.py"
  bad_py.write_text("X = 1\n")
  for argv, what, error in CONFIG_CASES:
    argv = [str(bad_py) if arg == "BAD_PY" else arg for arg in argv]
    s.case("config", what, lambda: cli(*argv, "--workdir", str(w)), error=error, unchanged=[w],
           setup=s.make("config", keep=True),
           command="run.py " + " ".join(argv))
  cpu8 = s.scratch / "cpu8"
  s.case("config", "batch not a multiple of devices (8 CPU devices)", lambda: cli(
      "train", *TINY, "--workdir", str(cpu8), "--set", "train.batch_size=6", env=EIGHT_DEVICES),
      error=r"^train\.batch_size 6 must be a multiple of the 8 devices", unchanged=[cpu8],
      setup=s.make("cpu8", trained=False),
      command="XLA_FLAGS=--xla_force_host_platform_device_count=8 run.py train ... "
      "--set train.batch_size=6")
  cli_cases(s, w)


def cli_cases(s: Sweep, w: pathlib.Path) -> None:
  keep = s.make("config", keep=True)  # the config cases' workdir
  s.case("cli", "unknown mode", lambda: cli("fly", *TINY, "--workdir", str(w)),
         error=r"argument mode: invalid choice: 'fly'", unchanged=[w], setup=keep,
         command="run.py fly ...")
  here = s.scratch / "cwd"  # a run without --workdir could only write where it runs
  s.case("cli", "missing --workdir", lambda: sh(
      str(ROOT / "run.py"), "train", "--config", f"{ROOT}/experiments/demo.py:tiny", cwd=here),
      error=r"the following arguments are required: --workdir", unchanged=[here],
      setup=s.make("cwd", trained=False),
      command="run.py train --config ... (in an empty folder)")
  s.case("cli", "--coordinator without the others", lambda: cli(
      "data", *TINY, "--workdir", str(w), "--coordinator", "127.0.0.1:1"),
      error=r"^--coordinator, --num_processes and --process_id go together", unchanged=[w],
      setup=keep)
  s.case("cli", "--process_id out of range", lambda: cli(
      "data", *TINY, "--workdir", str(w), "--coordinator", "127.0.0.1:1", "--num_processes", "2",
      "--process_id", "5"), error=r"^--process_id 5 must be in 0 \.\. 1", unchanged=[w],
      setup=keep)
  s.case("cli", "coordinator never comes (3 s)", lambda: cli(
      "data", *TINY, "--workdir", str(w), "--coordinator", "127.0.0.1:9", "--num_processes", "2",
      "--process_id", "1", "--init_timeout", "3"),
      error=r"^could not join the job of coordinator 127\.0\.0\.1:9 within 3 s", unchanged=[w],
      setup=keep)
  s.case("cli", "search without --query", lambda: cli("search", *TINY, "--workdir", str(w)),
         error=r"^search needs one or more non-empty --query", unchanged=[w], setup=keep)
  big = s.scratch / "bigk"
  s.case("cli", "search with top_k larger than the index (passages)", search_cli(
      big, "--set", "index.top_k=5000", "--set", "index.unit=passage"),
      setup=s.make("bigk"), unchanged=[big],
      expect=[("every paragraph of the corpus file listed, each once", lambda out: (
          every_passage_once(big / "data" / "corpus.json",
                             [m.group(3, 4) for m in SEARCH_LINE.finditer(out)])))],
      command="run.py search ... --set index.top_k=5000 --set index.unit=passage")


def data_cases(s: Sweep) -> None:
  folder = squad_files(s.scratch / "squad_ok")
  w = s.scratch / "data"

  def variant(name: str, train_text: str | bytes) -> pathlib.Path:
    path = s.scratch / name
    shutil.copytree(folder, path, dirs_exist_ok=True)
    target = path / "train-v1.1.json"
    target.write_bytes(train_text if isinstance(train_text, bytes) else train_text.encode())
    return path

  qa = {"id": "q", "question": "Who?", "answers": [{"text": "Ann", "answer_start": 0}]}
  cases = [
      (pathlib.Path("/no/such/dir"), "data.dir missing",
       r"^/no/such/dir/train-v1\.1\.json: cannot read: No such file or directory"),
      (variant("trunc", '{"data": ['), "truncated JSON",
       r"/trunc/train-v1\.1\.json: invalid JSON at line 1 column 11"),
      (variant("empty", ""), "empty train file", r"/empty/train-v1\.1\.json: file is empty$"),
      (variant("latin", bytes([0xff, 0xfe, 0x41])), "train file not UTF-8",
       r"/latin/train-v1\.1\.json: not valid UTF-8 \(byte 0"),
      (variant("list", "[1, 2]"), "JSON but not SQuAD",
       r"/list/train-v1\.1\.json: expected a JSON object with a 'data' list"),
      (variant("allbad", json.dumps({"data": [{"title": "T", "paragraphs": [
          {"context": "x", "qas": [{"id": "1"}]}]}]})),
       "no usable question", r"/allbad/train-v1\.1\.json: no usable questions$"),
  ]
  make = s.make("data", trained=False, keep=True)
  for path, what, error in cases:
    s.case("data", what, lambda: cli("data", *SQUAD_TINY, "--workdir", str(w), "--set",
           f"data.dir={path}"), error=error, unchanged=[w, path], setup=make,
           command=f"run.py data {' '.join(SQUAD_TINY)} --set data.dir={path.name}")
  dup = variant("dup", json.dumps({"data": [{"title": "T", "paragraphs": [
      {"context": "Ann met Bob. " * 3, "qas": [qa, qa, {**qa, "id": "r"}]}]}]}))
  s.case("data", "duplicate question ids (skipped, counted)",
         lambda: cli("data", *SQUAD_TINY, "--workdir", str(w), "--set", f"data.dir={dup}"),
         setup=make, unchanged=[w, dup],
         said=[printed(r"^\s+duplicate question id.*: 1 \(e\.g\.",
                       "the skip counted as a duplicate question id")],
         expect=[data_as_recounted(dup)])


def corpus_cases(s: Sweep) -> None:
  def corpus(name: str, text: str) -> pathlib.Path:
    path = s.scratch / name
    path.write_text(text, encoding="utf-8")
    return path

  lines = [json.dumps({"id": f"c{i}", "title": "T", "text": f"Ann met Bob number {i} here."})
           for i in range(4)]
  good, clean = [f"c{i}" for i in range(4)], "\n".join(lines) + "\n"
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
  w = s.scratch / "corpus"
  for what, text, error, said in cases:
    path = corpus(what[:8].replace(" ", "_") + ".jsonl", text)
    s.case("corpus", what, lambda: cli(
        "dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=c", "--set",
        f"index.corpus=['{path}']"), error=error, said=said,
        setup=s.make("corpus"),
        unchanged=[w, path] if error else [path],
        expect=[] if error else [dump_like(s, w / "c", clean, good)])
  w = s.scratch / "corpus_missing"
  s.case("corpus", "corpus file missing", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=c", "--set",
      "index.corpus=['/no/such/corpus.jsonl']"),
      error=r"^/no/such/corpus\.jsonl: corpus file not found", unchanged=[w],
      setup=s.make("corpus_missing"))
  w = s.scratch / "tokenless"
  zero = corpus("tokenless.jsonl", '{"id": "a", "title": "", "text": "\\u200b"}\n')
  setting = ["--set", "index.dump_name=z", "--set", f"index.corpus=['{zero}']"]
  s.case("corpus", "index of a dump with 0 tokens", lambda: cli(
      "index", *TINY, "--workdir", str(w), *setting),
      setup=s.make("tokenless", then=lambda: cli("dump", *TINY, "--workdir", str(w), *setting)),
      error=r"/z: the dump holds no token \(1 passages", unchanged=[w, zero],
      expect=[("the dump z/ before it: passage a, 0 vectors", lambda out: (
          [p[0] for p in stored_passages(w / "z")] == ["a"] and stored_vectors(w / "z") == 0))])
  questions_cases(s, corpus)


def questions_cases(s: Sweep, write) -> None:
  w = s.scratch / "questions"
  for number, (what, text, error) in enumerate([
      ("questions JSONL with a bad line", '{"question": "Who?", "answers": ["Ann"]}\n{oops\n',
       r"q\d+\.jsonl:2: invalid JSON at column 2"),
      ("question without answers", '{"data": [{"id": "1", "question": "Who?"}]}',
       r"q\d+\.json: record 0 needs a non-empty 'question' and a non-empty 'answers' list"),
      ("duplicate open question ids",
       '{"data": [{"id": "1", "question": "Who?", "answers": ["A"]}, '
       '{"id": "1", "question": "Who else?", "answers": ["B"]}]}',
       r"q\d+\.json: record 1: duplicate question id '1'"),
      ("empty questions file", "", r"q\d+\.json: file is empty$"),
  ]):
    suffix = ".jsonl" if "JSONL" in what else ".json"
    path = write(f"q{number}{suffix}", text)
    s.case("questions", what, lambda: cli("eval", *TINY, "--workdir", str(w), "--set",
           f"index.questions={path}"), error=error, unchanged=[w, path],
           setup=s.make("questions"))
  w = s.scratch / "questions_missing"
  s.case("questions", "questions file missing", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "index.questions=/no/such/q.json"),
      error=r"^/no/such/q\.json: questions file not found", unchanged=[w],
      setup=s.make("questions_missing"))


def state_cases(s: Sweep) -> None:
  empty = s.scratch / "untrained"
  untrained = r"/untrained has no checkpoints: train into it first"
  s.case("state", "dump from a workdir without checkpoints (mistyped)",
         lambda: cli("dump", *TINY, "--workdir", str(empty)), error=untrained,
         unchanged=[empty], setup=s.make("untrained", trained=False))
  s.case("state", "search in a workdir without checkpoints",
         lambda: cli("search", *TINY, "--workdir", str(empty), "--query", "who?"),
         error=untrained, unchanged=[empty], setup=s.make("untrained", trained=False))
  w = s.scratch / "nodump"
  s.case("state", "eval without a dump", lambda: cli("eval", *TINY, "--workdir", str(w)),
         error=r"/nodump/dump: no manifest\.json: not a phrase dump", unchanged=[w],
         setup=s.make("nodump", then=lambda: shutil.rmtree(w / "dump")))
  w = s.scratch / "noindex"
  s.case("state", "eval of an index never built", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "index.search_index=IVF4_SQ8"),
      error=r"/indexes/IVF4_SQ8: no index named 'IVF4_SQ8' \(available: \['Flat'\]\)",
      unchanged=[w], setup=s.make("noindex"))
  other = s.scratch / "other_corpus.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")
  w = s.scratch / "redump"
  s.case("state", "complete dump rerun with another corpus", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", f"index.corpus=['{other}']"),
      error=r"/redump/dump/shard_00000 holds other passages than the corpus gives now",
      unchanged=[w, other], setup=s.make("redump"))
  resumed_dump_case(s, other)
  w = s.scratch / "foreign_index"

  def foreign_index():
    shutil.rmtree(w / "dump" / "indexes")
    run = cli("dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2", "--set",
              f"index.corpus=['{other}']")
    shutil.copytree(s.base / "dump" / "indexes", w / "d2" / "indexes")
    return run
  s.case("state", "index of another dump of the same model", lambda: cli(  # (d2's own corpus)
      "eval", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2", "--set",
      f"index.corpus=['{other}']"),
      error=r"/foreign_index/d2/indexes/Flat was built from another dump than the one in",
      unchanged=[w], setup=s.make("foreign_index", then=foreign_index))
  damaged_dump_cases(s)
  checkpoint_and_workdir_cases(s)
  training_cases(s)


def checkpoint_and_workdir_cases(s: Sweep) -> None:
  """A damaged or missing checkpoint, a Flat index for quantised QSFT, a --workdir that is not
  a folder."""
  w, latest = s.scratch / "ckpt", {}

  def damage_checkpoint():
    latest["step"] = checkpoint_steps(w)[-1]
    for f in (w / "checkpoints" / str(latest["step"]) / "state").rglob("*"):
      if f.is_file() and f.stat().st_size > 1000:
        f.write_bytes(b"\0" * 16)
  s.case("state", "damaged checkpoint files", lambda: cli("eval", *TINY, "--workdir", str(w)),
         error=r"/ckpt/checkpoints/(\d+)/state/\S+: \d+ bytes, \d+ when it was written: the "
               r"checkpoint is damaged; delete .*/ckpt/checkpoints/\1 ",
         unchanged=[w], setup=s.make("ckpt", then=damage_checkpoint),
         said=[("names the latest checkpoint step, the one damaged", lambda out: re.search(
             rf"/ckpt/checkpoints/{latest['step']}/state/", final_line(out)))])
  w = s.scratch / "which"
  for what, settings, error in [
      ("eval.checkpoint=best without validation", ["eval.checkpoint=best"],
       r"/which/checkpoints_best: no best checkpoint"),
      ("eval.checkpoint=qsft without QSFT", ["eval.checkpoint=qsft"],
       r"/which/checkpoints_qsft: no qsft checkpoint"),
      ("re-read spans scored by QSFT's encoder without QSFT",
       ["index.reread=2", "index.reread_checkpoint=qsft"],
       r"/which/checkpoints_qsft: no qsft checkpoint")]:
    sets = [arg for setting in settings for arg in ("--set", setting)]
    s.case("state", what, lambda: cli("eval", *TINY, "--workdir", str(w), *sets),
           error=error, unchanged=[w], setup=s.make("which"))
  w = s.scratch / "qsftq"
  s.case("state", "quantisation-aware QSFT on a Flat index", lambda: cli(
      "qsft", *TINY, "--workdir", str(w), "--set", "qsft.quantized=True"),
      error=r"^qsft\.quantized: quantisation-aware QSFT needs an IVF index, not Flat",
      unchanged=[w], setup=s.make("qsftq"))
  f = s.scratch / "a_file"
  f.write_text("not a directory")
  for what, workdir, error in [
      ("--workdir is a file", f, r"--workdir \S+/a_file is a file, not a directory"),
      ("--workdir under a file", f / "sub", r"--workdir \S+/a_file/sub lies under \S+/a_file, "
       "which is a file")]:
    s.case("state", what, lambda: cli("train", *TINY, "--workdir", str(workdir)), error=error,
           unchanged=[f])


def resumed_dump_case(s: Sweep, other: pathlib.Path) -> None:
  w = s.scratch / "resumed_dump"
  small = ["--set", "index.shard_passages=5", "--set", "index.dump_name=d5"]

  def interrupted_dump():
    run = cli("dump", *TINY, "--workdir", str(w), *small)
    manifest = json.loads((w / "d5" / "manifest.json").read_text())
    (w / "d5" / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    shutil.rmtree(w / "d5" / manifest["shards"][-1]["name"])  # killed before the last shard
    return run
  s.case("state", "interrupted dump resumed with another corpus", lambda: cli(
      "dump", *TINY, "--workdir", str(w), *small, "--set", f"index.corpus=['{other}']"),
      error=r"/resumed_dump/d5/shard_00000 holds other passages than the corpus gives now",
      unchanged=[w, other], setup=s.make("resumed_dump", then=interrupted_dump))


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
  w = s.scratch / "damaged"
  for what, name, damage, error in cases:
    s.case("state", what, lambda: cli("eval", *TINY, "--workdir", str(w)), error=error,
           unchanged=[w], setup=s.make("damaged", then=lambda: damage(w / "dump" / name)))


def lock_and_verify_cases(s: Sweep) -> None:
  """One writer a workdir (workdir.lock, as train.lock); `run.py verify` and eval against the
  digests recorded when the index and checkpoints were written."""
  w = s.scratch / "held"
  holder = lambda: (w / "workdir.lock").write_text(  # noqa: E731  (this live process holds it)
      f"{os.getpid()} {socket.gethostname()} run.py dump --x")
  for what, mode in (("a dump while another writer holds the workdir", "dump"),
                     ("an index build while another writer holds the workdir", "index")):
    s.case("state", what, lambda: cli(mode, *TINY, "--workdir", str(w)),
           error=rf"/held/workdir\.lock: another run \(pid {os.getpid()}: run\.py dump --x\) is "
                 "using this workdir", unchanged=[w], setup=s.make("held", then=holder))
  w, dead = s.scratch / "gone", {}

  def dead_lock():
    dead["pid"] = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                 capture_output=True, text=True).stdout.strip()
    (w / "workdir.lock").write_text(f"{dead['pid']} {socket.gethostname()} run.py index")
  s.case("state", "an index build over a dead run's lock, then searched", lambda: chain(
      lambda: cli("index", *TINY, "--workdir", str(w)), search_cli(w, "--set", "index.top_k=3")),
      setup=s.make("gone", then=dead_lock),
      said=[("warned of the lock taken over", lambda out: re.search(
          rf"taking over the lock of a run that is gone \(pid {dead['pid']}", out))],
      expect=[("the lock released", lambda out: not (w / "workdir.lock").exists()),
              *index_checks(s, w, "Flat")])
  w = s.scratch / "sound"
  verified = re.compile(r"verify .*/sound: (\d+) artifacts verified, 0 unverified, 0 damaged")
  s.case("state", "verify of a sound workdir", lambda: cli("verify", *TINY, "--workdir", str(w)),
         setup=s.make("sound"), unchanged=[w],
         expect=[("as many artifacts verified as counted here (checkpoint steps, shards, "
                  "indexes), none unverified or damaged", lambda out: (
                      int(verified.search(out).group(1)) == workdir_artifacts(w)))])
  zeroed_cases(s)


def zeroed_cases(s: Sweep) -> None:
  """4 KiB of an artifact's file zeroed in place: verify and eval name the file."""
  w, picked = s.scratch / "zeroed", {}

  def checkpoint_array() -> str:
    step = w / "checkpoints" / str(checkpoint_steps(w)[-1])
    array = sorted((step / "state").rglob("d/*"), key=lambda p: p.stat().st_size)[-1]
    return str(array.relative_to(w))

  def zero(target):
    picked["target"] = target() if callable(target) else target
    path = w / picked["target"]
    data = bytearray(path.read_bytes())
    data[len(data) // 4:len(data) // 4 + 4096] = bytes(min(4096, len(data) - len(data) // 4))
    path.write_bytes(bytes(data))

  index = "dump/indexes/Flat/index.faiss"
  named = r"/zeroed/{}: its bytes differ from when it was written \(crc32\)"
  for what, target, mode, error in (
      ("verify of a zeroed faiss index", index, "verify",
       r"/zeroed: 1 damaged artifacts: .*/zeroed/dump/indexes/Flat "),
      ("eval of a zeroed faiss index", index, "eval", named.format(re.escape(index))),
      ("verify of a zeroed checkpoint array", checkpoint_array, "verify",
       r"/zeroed: 1 damaged artifacts: .*/zeroed/checkpoints/\d+ ")):
    s.case("state", what, lambda: cli(mode, *TINY, "--workdir", str(w)), error=error,
           unchanged=[w], setup=s.make("zeroed", then=lambda: zero(target)),
           said=[("names the zeroed file", lambda out: re.search(
               named.format(re.escape(picked["target"])), out))])


def training_cases(s: Sweep) -> None:
  w = s.scratch / "lambda"
  s.case("train", "resume with a changed loss setting", lambda: cli(
      "train", *TINY, "--workdir", str(w), "--set", "train.loss.lambda_inb=1.0"),
      error=r"/lambda/checkpoints holds a run trained with other settings.*lambda_inb",
      unchanged=[w], setup=s.make("lambda"))
  w = s.scratch / "lock"
  s.case("train", "a second training in the same workdir", lambda: cli(
      "train", *TINY, "--workdir", str(w)),
      error=rf"/lock/train\.lock: another training run \(pid {os.getpid()}\) is using this",
      unchanged=[w], setup=s.make("lock", trained=False, then=lambda: (
          w / "train.lock").write_text(str(os.getpid()))))  # this (live) process holds it
  torn_resume_case(s)
  w = s.scratch / "diverge"
  s.case("train", "diverging training (lr 1e6)", lambda: cli(
      "train", *TINY, "--workdir", str(w), "--set", "train.learning_rate=1e6", "--set",
      "train.warmup_steps=1", "--set", "train.freeze=[]", "--set", "train.checkpoint_every=1"),
      error=r"^training diverged at step \d+: loss nan.*nothing was saved from this step on",
      setup=s.make("diverge", trained=False), unchanged=[w],
      # what a training writes from its first step: the generated data set, the saved config, its
      # logs, and the checkpoints of the steps before it diverged (checked below)
      allowed=[r"^diverge/(data|tensorboard|checkpoints)(/|$)",
               r"^diverge/(dpjax_config\.json|metrics\.jsonl)$"],
      expect=[("checkpoints of exactly the steps before the divergence named (one a step)",
               lambda out: checkpoint_steps(w) == list(range(1, int(re.search(
                   r"diverged at step (\d+)", final_line(out)).group(1))))),
              ("the train losses logged (those steps') all finite", lambda out: all(
                  np.isfinite(r["loss"]) for r in metrics_records(w, "train")))])
  data = [s.scratch / f"sq{seed}" for seed in (0, 1)]
  w = s.scratch / "data_swap"
  base = ["train", *SQUAD_TINY, "--workdir", str(w), "--set", "eval.limit=4"]

  def three_steps():
    for seed, folder in enumerate(data):
      squad_files(folder, seed)
    return cli(*base, "--set", f"data.dir={data[0]}", "--set", "train.stop_at_step=3", "--set",
               "train.checkpoint_every=3")
  s.case("train", "resume with other data under data.dir", lambda: cli(
      *base, "--set", f"data.dir={data[1]}", "--set", "train.checkpoint_every=3"),
      error=r"/data_swap/checkpoints holds a run trained on other data than the configured",
      unchanged=[w, *data], setup=s.make("data_swap", trained=False, then=three_steps))


def torn_resume_case(s: Sweep) -> None:
  """A training killed while writing a metrics line, resumed: it must go on from its checkpoint,
  as the uninterrupted training of the base workdir went (same steps, same losses)."""
  w, first = s.scratch / "torn", {}

  def killed_at_step_3():
    run = cli("train", *TINY, "--workdir", str(w), "--set", "train.stop_at_step=3")
    first["lines"] = (w / "metrics.jsonl").read_text()
    first["checkpoints"] = file_stamps(w / "checkpoints")
    with (w / "metrics.jsonl").open("a") as f:
      f.write('{"step": 4, "spl')
    return run

  def kept_lines(out):
    lines = (w / "metrics.jsonl").read_text().splitlines(keepends=True)
    return "".join(lines[:len(first["lines"].splitlines())]) == first["lines"]

  def losses(workdir):
    return [(r["step"], r["loss"]) for r in metrics_records(workdir, "train")]

  def last_dev(workdir):
    return {k: metrics_records(workdir, "dev")[-1][k] for k in ("step", "rc_exact_match", "rc_f1")}
  s.case("train", "torn last metrics line, then resume", lambda: cli(
      "train", *TINY, "--workdir", str(w)), setup=s.make("torn", trained=False,
                                                          then=killed_at_step_3),
      said=[printed(r"dropping a torn last line", "warned of the torn line dropped")],
      expect=[("checkpoint steps on disk those of the uninterrupted run",
               lambda out: checkpoint_steps(w) == checkpoint_steps(s.base)),
              ("the first run's checkpoints not written again (sha256 and mtime of each file)",
               lambda out: {k: v for k, v in file_stamps(w / "checkpoints").items()
                            if k in first["checkpoints"]} == first["checkpoints"]),
              ("metrics.jsonl: the first run's lines kept byte for byte, the torn one dropped",
               kept_lines),
              ("train losses of every step (the first resumed one included) equal to the "
               "uninterrupted run's", lambda out: losses(w) == losses(s.base)),
              ("the last dev RC EM and F1 equal to the uninterrupted run's",
               lambda out: last_dev(w) == last_dev(s.base))])


def api_cases(s: Sweep) -> None:
  base, scratch = str(s.base), s.scratch / "api"
  scratch.mkdir(parents=True, exist_ok=True)
  (scratch / "empty").mkdir(exist_ok=True)
  (scratch / "list.json").write_text("[1]")
  index = (f"from dpjax.index.phrase_index import PhraseIndex\n"
           f"index = PhraseIndex('{base}/dump', 'Flat')")
  searcher = ("from dpjax.config import load_config\nfrom dpjax.main import open_searcher\n"
              "from dpjax.settings import Settings\n"
              f"searcher, _ = open_searcher(Settings.of(load_config('experiments/demo.py:tiny')), "
              f"'{base}')")
  query = "\nimport numpy as np\nq = np.ones((1, 30), 'float32')\n"
  demo = ROOT / "experiments" / "demo.py"
  cases = [
      ("PhraseIndex.search(k=0)", index + query + "index.search(q, q, 0)", [s.base],
       ("ValueError", r"k \(the number of results\) must be >= 1 \(an integer\), got 0$")),
      ("PhraseIndex.search_phrases(k=-1)", index + query + "index.search_phrases(q, q, -1)",
       [s.base], ("ValueError", r"k \(the number of phrases\) must be >= 1 \(an integer\), "
                  "got -1$")),
      ("PhraseIndex(nprobe=-1)", index.replace("'Flat')", "'Flat', nprobe=-1)"), [s.base],
       ("ValueError", r"nprobe must be >= 1, got -1$")),
      ("PhraseIndex of a missing index", index.replace("'Flat')", "'IVF9')"), [s.base],
       ("DumpError", r"/dump/indexes/IVF9: no index named 'IVF9' \(available: \['Flat'\]\)")),
      ("DensePhrases.search([])", searcher + "\nsearcher.search([])", [s.base],
       ("ValueError", r"^ERROR ValueError: no questions to encode$")),
      ("DensePhrases.search(unit='word')", searcher + "\nsearcher.search('who?', unit='word')",
       [s.base], ("ValueError", r"unknown retrieval unit 'word'")),
      ("read_corpus of a missing file", "from dpjax.data.corpus import read_corpus\n"
       f"list(read_corpus('{scratch}/no_such.jsonl'))", [scratch],
       ("DataError", r"/no_such\.jsonl: corpus file not found$")),
      ("load_config with a bad override", "from dpjax.config import load_config\n"
       "load_config('experiments/demo.py', ['index.top_k=0'])", [demo],
       ("ConfigError", r"index\.top_k = 0: must be a number >= 1$")),
      ("read_questions of a JSON list", "from dpjax.data.questions import read_questions\n"
       f"read_questions('{scratch}/list.json')", [scratch],
       ("DataError", r"list\.json: expected a 'data' list$")),
      ("restore_model of an empty workdir", "from dpjax.config import load_config\n"
       "from dpjax.main import restore\nfrom dpjax.settings import Settings\nrestore("
       f"Settings.of(load_config('experiments/demo.py:tiny')), '{scratch}/empty')", [scratch],
       ("DataError", r"/api/empty has no checkpoints: train into it first")),
  ]
  for what, code, unchanged, raises in cases:
    s.case("api", what, lambda: api(code), raises=raises, unchanged=unchanged,
           command="python -c ...")
  api_k_case(s, index + query)


def api_k_case(s: Sweep, index: str) -> None:
  """PhraseIndex.search and search_phrases with k past the index's size: every passage once,
  and phrases within it (no padding id -1, no token past the vectors)."""
  listed = {}

  def parse(out):
    for name in ("PASSAGES", "PHRASES"):
      listed[name] = json.loads(re.search(rf"^{name} (.*)$", out, re.M).group(1))
    return listed

  def phrases_within(out):
    passages, vectors = len(corpus_paragraphs(s.base / "data" / "corpus.json")), stored_vectors(
        s.base / "dump")
    phrases = parse(out)["PHRASES"]
    return phrases and all(0 <= p < passages and 0 <= start <= end < vectors
                           for p, start, end in phrases)
  s.case("api", "PhraseIndex.search with k larger than the index", lambda: api(
      index + "units = index.search(q, q, 10**6, unit='passage')[0]\n"
      "import json\nprint('PASSAGES', json.dumps([str(key) for _, key in units]))\n"
      "phrases = index.search_phrases(q, q, 10**6)[0]\nprint('PHRASES', json.dumps("
      "[[int(p.passage), int(p.start_token), int(p.end_token)] for p in phrases]))"),
      unchanged=[s.base],
      expect=[("as many passages, each once, as the corpus file has paragraphs", lambda out: (
          len(set(parse(out)["PASSAGES"])) == len(listed["PASSAGES"])
          == len(corpus_paragraphs(s.base / "data" / "corpus.json")))),
              ("search_phrases: some phrases, each of a passage and tokens of the dump",
               phrases_within)],
      command="python -c ...")


def audit_cases(s: Sweep) -> None:
  """The inputs and states the helpers' audits of 2026-11-27 found mishandled (each now has a
  test: DEFECT_TESTS)."""
  folder = squad_files(s.scratch / "squad_audit")
  w = s.scratch / "audit_data"
  qas_not_a_list = json.dumps({"data": [{"title": "T", "paragraphs": [
      {"context": "Ann met Bob.", "qas": {"id": "q", "question": "Who?", "answers": [
          {"text": "Ann", "answer_start": 0}]}},
      {"context": "Bob met Ann.", "qas": [{"id": "r", "question": "Who?", "answers": [
          {"text": "Bob", "answer_start": 0}]}]}]}]})
  for number, (what, text, error) in enumerate([
      ("JSON nested past the recursion limit", "[" * 100000 + "]" * 100000,
       r"/audit_\d+/train-v1\.1\.json: invalid JSON: nested too deeply"),
      ("'qas' not a list (skipped, counted)", qas_not_a_list, None)]):
    path = s.scratch / f"audit_{number}"
    shutil.rmtree(path, ignore_errors=True)  # a kept scratch folder of an earlier run
    shutil.copytree(folder, path)
    (path / "train-v1.1.json").write_text(text)
    s.case("data", what, lambda: cli("data", *SQUAD_TINY, "--workdir", str(w), "--set",
           f"data.dir={path}"), error=error, unchanged=[w, path],
           setup=s.make("audit_data", trained=False, keep=True),
           said=[] if error else [printed(r"^\s+'qas' is not a list.*: 1 \(e\.g\.",
                                          "the skip counted as 'qas' not a list")],
           expect=[] if error else [data_as_recounted(path)])
  huge = s.scratch / "huge_int.jsonl"
  record = json.dumps({"id": "a", "title": "T", "text": "Ann met Bob."}) + "\n"
  huge.write_text(record + '{"id": "b", "n": ' + "9" * 5000 + "}\n")
  w = s.scratch / "huge"
  s.case("corpus", "a 5,000-digit integer in a JSONL line (skipped, counted)", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=h", "--set",
      f"index.corpus=['{huge}']"), setup=s.make("huge"), unchanged=[huge],
      said=[printed(r"skipped 1 record\(s\)"), printed(r"^\s+invalid JSON line: 1 ")],
      expect=[dump_like(s, w / "h", record, ["a"])])
  stale_cases(s)
  spec_cases(s)
  w = s.scratch / "zw"
  questions = s.scratch / "zero_width.jsonl"
  questions.write_text('{"id": "a", "question": "Who?", "answers": ["Ann"]}\n'
                       '{"id": "zw", "question": "\\u200b", "answers": ["Ann"]}\n')
  s.case("questions", "a question of only a zero-width space", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", f"index.questions={questions}"),
      error=r"zero_width\.jsonl: 1 questions hold no token, e\.g\. zw",
      unchanged=[w, questions], setup=s.make("zw"))


def stale_cases(s: Sweep) -> None:
  """A dump that no longer matches what the config names (corpus, windows, filter head)."""
  other = s.scratch / "audit_other.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")
  w = s.scratch / "stale"
  s.case("state", "index over a dump of another corpus than index.corpus", lambda: cli(
      "index", *TINY, "--workdir", str(w), "--set", f"index.corpus=['{other}']"),
      error=r"/stale/dump is a dump of another corpus", unchanged=[w, other],
      setup=s.make("stale"))
  s.case("state", "eval with other windows than the dump's", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "data.doc_stride=20"),
      error=r"/stale/dump is a dump of other windows: doc_stride 48 \(the config's 20\)",
      unchanged=[w], setup=s.make("stale"))
  w = s.scratch / "head"
  s.case("state", "dump rerun after a filter head appeared", lambda: cli(
      "dump", *TINY, "--workdir", str(w)),
      error=r"/head/dump holds a dump made with another token filter head \(filter_head\.npz\)",
      unchanged=[w], setup=s.make("head", then=lambda: np.savez(
          w / "filter_head.npz", kernel=np.zeros((30, 2), np.float32),
          bias=np.zeros(2, np.float32))))


def spec_cases(s: Sweep) -> None:
  """Index specs the tiny dump is too small for, built and then searched."""
  w = s.scratch / "spec"
  for spec, folder, resolved in (("SQ8", "SQ8", "SQ8"), ("HNSW16", "HNSW16", "HNSW16"),
                                 ("IVF4096,Flat", "IVF4096_Flat", None)):
    s.case("index", f"index.specs=['{spec}'] on the tiny dump, then searched", lambda: chain(
        lambda: cli("index", *TINY, "--workdir", str(w), "--set", f"index.specs=['{spec}']"),
        search_cli(w, "--set", f"index.search_index={folder}", "--set", "index.top_k=3")),
        setup=s.make("spec"), expect=index_checks(s, w, folder, resolved))


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


def summary(rows: list[dict]) -> dict:
  """Counts of `rows` (Sweep.rows): cases by verdict; for each check kind the cases making it and
  those whose checks of it all held; the refusals, and those whose artifacts were unchanged."""
  def made(row, kind):
    return [c["passed"] for c in row["checks"] if c["kind"] == kind]

  refusals = [r for r in rows if r["refusal"]]
  return {
      "cases": len(rows), "refusals": len(refusals),
      "verdicts": {v: sum(r["verdict"] == v for r in rows)
                   for v in ("clean", "traceback", "silent", "hang", "not run")},
      "kinds": {k: {"cases": sum(bool(made(r, k)) for r in rows),
                    "held": sum(bool(made(r, k)) and all(made(r, k)) for r in rows)}
                for k in KINDS},
      "refusals_unchanged": {
          "checked": sum(bool(made(r, "artifacts_unchanged")) for r in refusals),
          "held": sum(bool(made(r, "artifacts_unchanged")) and all(made(r, "artifacts_unchanged"))
                      for r in refusals)},
  }


def render(results: dict, command: str) -> str:
  rows, counts = results["cases"], summary(results["cases"])
  verdicts, dirty = counts["verdicts"], results.get("dirty_files", [])
  tree = (f"; {len(dirty)} tracked files differed from it: {', '.join(dirty[:8])}"
          + (" ..." if len(dirty) > 8 else "") if dirty else "; the tree clean")
  lines = ["# Reliability: the hostile sweep", "",
           f"Command: `{command}` (one process per case, {results['seconds']:.0f} s in all), at "
           f"commit `{results['commit']}`{tree}.", "",
           f"{counts['cases']} cases: {counts['refusals']} refusals (bad input or state, to be "
           f"refused with exit 2) and {counts['cases'] - counts['refusals']} runs (to be handled, "
           f"exit 0). **{verdicts['clean']} clean**, {verdicts['traceback']} tracebacks, "
           f"{verdicts['silent']} silent (a check failed without a traceback: a wrong result, a "
           f"changed artifact, a wrong message or status), {verdicts['hang']} hangs.", "",
           "A case is clean when every check it made held. Its checks, by kind (each case's "
           "are listed in the table below, and stated in `experiments/studies/"
           "hostile_sweep.py`):", "",
           "| kind | what it compares | cases making it | of them, all held |", "|---|---|---|---|"]
  lines += [f"| {kind} | {text} | {counts['kinds'][kind]['cases']} | "
            f"{counts['kinds'][kind]['held']} |" for kind, text in KINDS.items()]
  allowed = "; ".join(f"`{name}`: {why}" for name, why in ALLOWED_CHANGES.items())
  refusals = counts["refusals_unchanged"]
  lines += ["", f"Refusals checking their artifacts unchanged (sha256 of every file under the "
            f"case's workdir and input files, before the run and after): "
            f"{refusals['checked']} of {counts['refusals']}; unchanged in {refusals['held']}. "
            f"Files any run may change, left out of that check: {allowed}. A case's own "
            "exceptions are named in its check.", "",
            "| # | area | case | exit | verdict | kinds | checks (✗: failed) | final line |",
            "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    checks = "; ".join(("✗ " if c["passed"] is False else "") + c["what"] for c in r["checks"])
    changed = [f for f in r["failed"] if ": changed " in f]
    checks += f" **{'; '.join(changed)}**" if changed else ""
    cells = [str(r["id"]), r["area"], r["case"], str(r["exit"]), r["verdict"],
             ", ".join(r["kinds"]), checks, r["message"]]
    lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
  lines += ["", "## The sweeps' defects and their tests (`tests/test_reliability.py` unless "
            "named)", "", "| defect | test |", "|---|---|"]
  lines += [f"| {defect} | `{test}` |" for defect, test in DEFECT_TESTS]
  return "\n".join(lines) + "\n"


def compact_cases(s: Sweep) -> None:
  """Compact indexes and codes dumps: a filter or a codec that leaves nothing to build, another
  dump's compact index, and its parts damaged on disk; each refused in one line, nothing
  written."""
  compact = "index.specs=['compact:SQ8']"
  folder = "compact_SQ8"
  w = s.scratch / "compact_empty"
  s.case("compact", "a compact index whose filter keeps no token", lambda: cli(
      "index", *TINY, "--workdir", str(w), "--set", compact, "--set",
      "index.filter_threshold=10000.0"),
      error=r"no token passes the filter threshold", unchanged=[w], setup=s.make("compact_empty"))
  w = s.scratch / "codes_empty"
  s.case("compact", "a codes dump whose filter keeps no sampled token", lambda: cli(
      "dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=codes", "--set",
      "index.dump_codec=SQ8", "--set", "index.dump_filter_threshold=60000.0"),
      error=r"index\.dump_filter_threshold", unchanged=[w], setup=s.make("codes_empty"))
  w = s.scratch / "codec_untrainable"
  # (a codec of more bits than the sample can train is clamped, as any index's: `resolve_spec`)
  s.case("compact", "a codec faiss cannot make of these vectors (7 sub-vectors)", lambda: cli(
      "index", *TINY, "--workdir", str(w), "--set", "index.specs=['compact:PQ7']"),
      error=r"PQ7", unchanged=[w], setup=s.make("codec_untrainable"))

  def build(w: pathlib.Path, *sets: str):
    return lambda: cli("index", *TINY, "--workdir", str(w), "--set", compact, *sets)
  w = s.scratch / "compact_foreign"
  other = s.scratch / "compact_other.jsonl"
  other.write_text(json.dumps({"id": "z", "title": "Z", "text": "Zed was here long ago."}) + "\n")

  def foreign():
    build(w)()
    cli("dump", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2", "--set",
        f"index.corpus=['{other}']")
    shutil.copytree(w / "dump" / "indexes" / folder, w / "d2" / "indexes" / folder)
  s.case("compact", "a compact index of another dump", lambda: cli(
      "eval", *TINY, "--workdir", str(w), "--set", "index.dump_name=d2", "--set",
      f"index.corpus=['{other}']", "--set", f"index.search_index={folder}"),
      error=rf"/d2/indexes/{folder} was built from another dump than the one in",
      unchanged=[w, other], setup=s.make("compact_foreign", then=foreign))
  w = s.scratch / "compact_damaged"
  for what, name, damage, error in [
      ("a compact index's codes truncated", "codes.npy",
       lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size // 2]),
       r"codes\.npy: \d+ bytes, \d+ when it was written"),
      ("a compact index's codes zeroed", "codes.npy",
       lambda p: p.write_bytes(b"\0" * p.stat().st_size), r"codes\.npy: its bytes differ"),
      ("a compact index's passages zeroed", "passages.bin",
       lambda p: p.write_bytes(b"\0" * p.stat().st_size), r"passages\.bin: its bytes differ")]:

    def built_then_damaged(name=name, damage=damage) -> None:
      build(w)()
      damage(w / "dump" / "indexes" / folder / name)
    s.case("compact", what, lambda: cli("eval", *TINY, "--workdir", str(w), "--set",
                                        f"index.search_index={folder}"),
           error=rf"/indexes/{folder}/{error}", unchanged=[w],
           setup=s.make("compact_damaged", then=built_then_damaged))
  w = s.scratch / "bm25_damaged"
  hybrid = ("--set", "index.sparse=True", "--set", "index.sparse_weight=1")

  def bm25_then_damaged() -> None:
    cli("index", *TINY, "--workdir", str(w), *hybrid)
    path = w / "dump" / "indexes" / "bm25" / "sentence_df.npy"
    path.write_bytes(b"\0" * path.stat().st_size)
  s.case("compact", "a BM25 index's sentence frequencies zeroed", lambda: cli(
      "eval", *TINY, "--workdir", str(w), *hybrid),
      error=r"/indexes/bm25/sentence_df\.npy: its bytes differ .*the BM25 index is damaged",
      unchanged=[w],
      setup=s.make("bm25_damaged", then=bm25_then_damaged))


def residual_cases(s: Sweep) -> None:
  """Residual (`compact:qw+pr:`) indexes and re-reading: a residual code over a dump of codes
  only, a residual index's own parts damaged (refused in one line, nothing written), and a
  re-reading search of a compact index against the exact one."""
  w = s.scratch / "residual_codes_dump"
  codes = ("--set", "index.dump_name=codes", "--set", "index.dump_codec=SQ8", "--set",
           "index.dump_vectors=False")
  s.case("compact", "a residual index of a dump of codes only", lambda: cli(
      "index", *TINY, "--workdir", str(w), *codes, "--set", "index.specs=['compact:pr:SQ8']"),
      error=r"/codes: .* needs the dump's float16 token vectors, and the dump has none",
      unchanged=[w], setup=s.make("residual_codes_dump",
                                  then=lambda: cli("dump", *TINY, "--workdir", str(w), *codes)))
  spec, folder = "compact:qw+pr:SQ8", "compact_qw_pr_SQ8"
  w = s.scratch / "residual_damaged"
  for what, name, damage, error in [
      ("a residual index's passage means zeroed", "passage_means.npy",
       lambda p: p.write_bytes(b"\0" * p.stat().st_size), r"passage_means\.npy: its bytes differ"),
      ("a residual index's question weighting truncated", "weighting.npy",
       lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size // 2]),
       r"weighting\.npy: \d+ bytes, \d+ when it was written")]:

    def built_then_damaged(name=name, damage=damage) -> None:
      cli("index", *TINY, "--workdir", str(w), "--set", f"index.specs=['{spec}']")
      damage(w / "dump" / "indexes" / folder / name)
    s.case("compact", what, lambda: cli("eval", *TINY, "--workdir", str(w), "--set",
                                        f"index.search_index={folder}"),
           error=rf"/indexes/{folder}/{error}", unchanged=[w],
           setup=s.make("residual_damaged", then=built_then_damaged))
  residual_dump_cases(s)
  w = s.scratch / "reread"
  s.case("compact", "a compact index searched re-reading its top 2 passages",
         search_cli(w, "--set", "index.search_index=compact_SQ8", "--set", "index.reread=2"),
         expect=[(f"its top answer for {QUESTION!r} is a clean Flat search's",
                  lambda out: top_hits(out, 1) == s.flat_hits()[:1])],
         setup=s.make("reread", then=lambda: cli("index", *TINY, "--workdir", str(w), "--set",
                                                 "index.specs=['compact:SQ8']")))


def residual_dump_cases(s: Sweep) -> None:
  """Residual codes made at dump time (`index.dump_codec=qw+pr:...`): a question-weighted codec
  without training questions, and a dump whose weighting was changed after its codes."""
  dumped = ("--set", "index.dump_codec=qw+pr:SQ8", "--set", "index.dump_vectors=False")
  w = s.scratch / "residual_dump_no_questions"
  s.case("compact", "a qw+pr dump codec without training questions", lambda: cli(
      "dump", *TINY, "--workdir", str(w), *dumped, "--set", "index.dump_name=coded", "--set",
      "index.sparse_tune_file=/nonexistent.json"),
      error=r"/nonexistent\.json: questions file not found", unchanged=[w],
      setup=s.make("residual_dump_no_questions"))
  w = s.scratch / "residual_dump_damaged"

  def dumped_then_damaged() -> None:
    cli("dump", *TINY, "--workdir", str(w), *dumped, "--set", "index.dump_name=coded")
    weighting = w / "coded" / "weighting.npy"
    weighting.write_bytes(b"\0" * weighting.stat().st_size)
  s.case("compact", "a residual codes dump's question weighting zeroed", lambda: cli(
      "index", *TINY, "--workdir", str(w), *dumped, "--set", "index.dump_name=coded", "--set",
      "index.specs=['compact:qw+pr:SQ8']"),
      error=r"/coded/weighting\.npy: missing or not the file the codes were made with",
      unchanged=[w], setup=s.make("residual_dump_damaged", then=dumped_then_damaged))


GROUPS = (config_cases, data_cases, corpus_cases, state_cases, lock_and_verify_cases, api_cases,
          audit_cases, compact_cases, residual_cases)


def dirty_files() -> list[str]:
  """The tracked files that differ from HEAD (the results then are of HEAD and these changes)."""
  status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                          capture_output=True, text=True).stdout
  return [line[3:] for line in status.splitlines() if line.strip()]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/reliability.json")
  parser.add_argument("--keep", help="scratch folder to keep (default: a temporary one)")
  parser.add_argument("--only", default="", help="run only the cases whose name holds this")
  parser.add_argument("--subset", choices=("all", "fast"), default="all",
                      help="fast: the cases of FAST, a few minutes (`make test` runs them)")
  parser.add_argument("--dry", action="store_true", help="run nothing: list the selected cases "
                      "and the kinds of checks each makes")
  parser.add_argument("--render", metavar="COMMAND",
                      help="measure nothing: rewrite the Markdown of --out's JSON, stating COMMAND "
                      "as the command that measured it")
  args = parser.parse_args(argv)
  from experiments.report import git_commit, save_results
  if args.render:
    from dpjax.io import write_text_atomic
    results = json.loads(pathlib.Path(args.out).read_text())
    write_text_atomic(pathlib.Path(args.out).with_suffix(".md"), render(results, args.render))
    return 0
  scratch = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="dpjax-sweep-"))
  scratch.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  base = scratch / "base"
  if not args.dry and not (base / "dump" / "indexes" / "Flat").is_dir():
    prepare(base)
  sweep = Sweep(base, scratch, args.only, args.subset, dry=args.dry)
  for group in GROUPS:
    group(sweep)
  if not args.keep:
    shutil.rmtree(scratch, ignore_errors=True)
  if args.dry:
    for r in sweep.rows:
      print(f"{r['id']:3d} {r['area']:9s} {'refusal' if r['refusal'] else 'run':7s} "
            f"{', '.join(r['kinds'])}: {r['case']}")
    counts = summary(sweep.rows)  # (nothing ran: no check held or failed)
    print(f"{counts['cases']} cases, {counts['refusals']} refusals; cases making each kind of "
          f"check: {json.dumps({k: v['cases'] for k, v in counts['kinds'].items()})}")
    return 0
  results = {"cases": sweep.rows, "seconds": time.perf_counter() - start,
             "commit": git_commit(), "dirty_files": dirty_files(), "subset": args.subset,
             "only": args.only, "summary": summary(sweep.rows)}
  save_results(args.out, results, render, "experiments/studies/hostile_sweep.py", argv)
  return 1 if any(r["verdict"] != "clean" for r in sweep.rows) else 0


if __name__ == "__main__":
  sys.exit(main())
