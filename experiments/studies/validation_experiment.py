"""Kim et al. (2022), Figure 2 at our scale: do small hard subcorpora rank models like the corpus?

For every model (a workdir and a checkpoint step): the full corpus is dumped once with it
(`<workdir>/dump_step<N>`, resumable), and its accuracy is measured on the dev questions over
each subcorpus written by `run.py subcorpus` (C0, R_r, H_k) and over the full corpus, all as exact
(Flat) indexes over the subsets of that one dump. Reading-comprehension EM/F1 (single passage)
is measured too. Then, for each subcorpus, Kendall's tau between its ranking of the models and
the full corpus's ranking.

  python run.py subcorpus --config experiments/squad.py:cpu --workdir workdirs/squad-cpu-unified
  python experiments/studies/validation_experiment.py --config experiments/squad.py:cpu \\
      --subcorpora workdirs/squad-cpu-unified/subcorpora \\
      --model original-900=workdirs/squad-cpu-original@900 \\
      --model unified-900=workdirs/squad-cpu-unified@900 ... \\
      --out results/validation.json

`--reference results/validation_1500.json:unified-inb1-1500 --compare new:unified-inb1-1500`
pairs a model with one of an earlier report of the same sampled dev questions (its workdir may
be gone: its per-question full-corpus hits are in that report).

writes results/validation.json (every figure) and results/validation.md (tables, tau, the
command); `experiments/notebooks/validation.ipynb` draws the figure from the JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from experiments.report import mcnemar_p, p_text  # noqa: E402

METRICS = ("em@1", "em@10", "top1", "top20")


def kendall_tau(a, b) -> float:
  """Kendall's tau-b of two score lists (ties counted as neither concordant nor discordant)."""
  n = len(a)
  concordant = discordant = ties_a = ties_b = 0
  for i in range(n):
    for j in range(i + 1, n):
      da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
      if da == 0 and db == 0:
        continue
      if da == 0:
        ties_a += 1
      elif db == 0:
        ties_b += 1
      elif da == db:
        concordant += 1
      else:
        discordant += 1
  denominator = np.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
  return float((concordant - discordant) / denominator) if denominator else float("nan")


def parse_model(spec: str) -> tuple[str, pathlib.Path, int | None]:
  """'name=workdir@step' (step optional: the latest)."""
  if "=" not in spec:
    raise SystemExit(f"--model {spec!r}: expected NAME=WORKDIR[@STEP]")
  name, rest = spec.split("=", 1)
  workdir, _, step = rest.partition("@")
  return name, pathlib.Path(workdir), int(step) if step else None


def load_subcorpora(directory: pathlib.Path, corpus) -> dict[str, dict]:
  """{kind: {"rows", "meta"}} of the subcorpus files in `directory`, as rows of `corpus`."""
  from dpjax.data.squad import load_json
  row_of = {p.id: i for i, p in enumerate(corpus)}
  found = {}
  for meta_path in sorted(directory.glob("*.meta.json")):
    meta = load_json(meta_path)
    jsonl = meta_path.with_name(meta_path.name.replace(".meta.json", ".jsonl"))
    ids = [json.loads(line)["id"] for line in jsonl.read_text().splitlines() if line.strip()]
    missing = [i for i in ids if i not in row_of]
    if missing:
      raise SystemExit(f"{jsonl}: {len(missing)} passages are not in the corpus (e.g. "
                       f"{missing[0]!r})")
    found[meta["kind"]] = {"rows": np.array([row_of[i] for i in ids]), "meta": meta}
  if not found:
    raise SystemExit(f"{directory}: no subcorpus (run `run.py subcorpus` first)")
  questions = {m["meta"].get("questions") for m in found.values()}
  if len(questions) > 1:
    raise SystemExit(f"{directory}: the subcorpora were built for different question files "
                     f"{sorted(map(str, questions))}: rebuild them with one `run.py subcorpus`")
  return found


def subcorpus_order(kind: str) -> tuple[int, float]:
  """C0, then R_r by r, then H_k by k, then the full corpus."""
  from dpjax.validation import parse_kind
  family, value = parse_kind(kind)
  return ("C", "R", "H", "full").index(family), value


def questions_file(subcorpora: dict, default: str) -> str:
  """The dev questions the subcorpora were built for (C0 = their gold passages)."""
  return next(iter(subcorpora.values()))["meta"].get("questions") or default


def cache_key(subcorpora: dict, questions: list, config) -> str:
  """What a model's cached figures depend on besides the model: subcorpora, questions, settings."""
  import hashlib
  payload = {"format": 2,  # 2: per-question hits on the full corpus
             "rows": {k: v["rows"].tolist() for k, v in sorted(subcorpora.items())},
             "questions": [q.id for q in questions],
             "max_answer_length": config.eval.max_answer_length,
             "data": {k: getattr(config.data, k) for k in ("max_seq_length", "doc_stride",
                                                           "max_query_length", "include_title")}}
  if dump_dtype(config) != "float32":  # (float32 keys unchanged: earlier caches stay valid)
    payload["dump_dtype"] = dump_dtype(config)
  return hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def dump_dtype(config) -> str:
  """The compute dtype of the config's dumps (`index.dump_dtype`, else `model.dtype`)."""
  return config.index.dump_dtype or config.model.dtype


def dtype_suffix(dtype: str) -> str:
  """What a model's dump folder and figures file add for a dump not computed in float32."""
  return "" if dtype == "float32" else f"_{dtype}"


def model_dump_dir(workdir: pathlib.Path, step: int, dtype: str = "float32") -> pathlib.Path:
  """The model's existing full dump (`<workdir>/dump`) when it was made at `step` in `dtype`,
  else `<workdir>/dump_step<step>[_<dtype>]` (made or resumed here). `dump_phrases` refuses a
  dump of other parameters or settings either way."""
  from dpjax.index.manifest import read_manifest
  default = workdir / "dump"
  if (default / "manifest.json").is_file():
    manifest = read_manifest(default)
    if (manifest["model"].get("step") == step
        and manifest["settings"].get("compute_dtype", "float32") == dtype):
      return default
  return workdir / f"dump_step{step}{dtype_suffix(dtype)}"


def dump_fingerprint(workdir: pathlib.Path, step: int, dtype: str = "float32") -> str | None:
  """The encoder fingerprint of the model's dump (in `dtype`, or else in float32: the parameters'
  fingerprint is the same); None when the dump is gone (deleted after its figures were cached):
  that model then cannot be recognised as the H_k builder."""
  from dpjax.errors import DumpError
  from dpjax.index.manifest import read_manifest
  for kind in dict.fromkeys([dtype, "float32"]):
    try:
      return read_manifest(model_dump_dir(workdir, step, kind))["fingerprint"]
    except DumpError:
      continue
  return None


def evaluate_model(config, name, workdir, step, corpus, subcorpora, questions, rc_split,
                   tokenizer, mesh, batch_size, key) -> dict:
  """The model's figures; cached in `<workdir>/validation_step<N>.json` under `key` (a rerun
  with more models evaluates only the new ones)."""
  from dpjax.io import write_json
  from dpjax.data.squad import load_json
  from dpjax.index.dump import dump_phrases
  from dpjax.index.dump_reader import Dump
  from dpjax.index.manifest import dump_config, params_fingerprint
  from dpjax.main import restore
  from dpjax.parallel import make_mesh
  from dpjax.reading import evaluate_rc
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.models.encoders import encode_questions
  from dpjax.index.evaluate import retrieval_scores

  model, step = restore(config, workdir, step)
  cache = workdir / f"validation_step{step}{dtype_suffix(dump_dtype(config))}.json"
  parameters = params_fingerprint(model)  # a retrained workdir must not reuse old figures
  if cache.is_file():
    cached = load_json(cache)
    if cached.get("key") == key and cached.get("parameters") == parameters:
      logging.info("%s: figures of step %d from %s", name, step, cache)
      return cached["result"]
  start = time.perf_counter()
  dump_dir = model_dump_dir(workdir, step, dump_dtype(config))
  local = make_mesh(local=True)
  dump_phrases(model, tokenizer, corpus, dump_dir,
               dump_config(config.data, config.index, config.model.dtype, local), mesh=local,
               workers=config.index.dump_workers,
               model_info={"workdir": str(workdir), "step": step})
  dump = Dump.load(dump_dir)
  if [p.id for p in dump.passages] != [p.id for p in corpus]:  # subcorpus rows index the corpus
    raise SystemExit(f"{dump_dir} is not a dump of the configured corpus ({len(dump.passages)} "
                     f"vs {len(corpus)} passages, or another order)")
  logging.info("%s: dump of %d tokens in %.0f s", name, len(dump.vectors),
               time.perf_counter() - start)
  q_start, q_end = encode_questions(model, tokenizer, [q.question for q in questions],
                                    max_query_length=config.data.max_query_length,
                                    batch_size=batch_size, mesh=mesh)
  answers = [q.answers for q in questions]
  rc, _ = evaluate_rc(model, rc_split.features, rc_split.passages, rc_split.questions, mesh=mesh,
                      batch_size=batch_size, max_answer_length=config.eval.max_answer_length)
  result = {"workdir": str(workdir), "step": step, "rc_em": rc["exact_match"],
            "rc_f1": rc["f1"], "subcorpora": {}}
  for kind, sub in {**subcorpora, "full": {"rows": None}}.items():
    index = PhraseIndex.over_passages(dump, sub["rows"])
    report = retrieval_scores(index, q_start, q_end, answers,
                              max_answer_length=config.eval.max_answer_length,
                              per_question=sub["rows"] is None)  # paired tests on the full C
    report.update(passages=index.manifest["num_passages"], tokens=index.manifest["num_tokens"])
    result["subcorpora"][kind] = report
    logging.info("%s step %s, %s (%d tokens): EM@1 %.2f EM@10 %.2f top20 %.2f", name, step,
                 kind, report["tokens"], report["em@1"], report["em@10"], report["top20"])
  write_json(cache, {"key": key, "parameters": parameters, "result": result})
  return result


def load_references(specs: list[str], subcorpora: dict, questions: int) -> dict[str, dict]:
  """{name: figures} of models from earlier reports of this script (`FILE:MODEL`), for paired
  tests on the same questions. Refused unless that report sampled the same dev questions: the
  same count and the same C0 (corpus files, sample size, seed, passages)."""
  fields = ("corpus", "sample_questions", "seed", "passages")
  found = {}
  for spec in specs:
    path, sep, name = spec.rpartition(":")
    if not sep or not pathlib.Path(path).is_file():
      raise SystemExit(f"--reference {spec!r}: expected FILE:MODEL of an existing report")
    report = json.loads(pathlib.Path(path).read_text())
    if name not in report.get("models", {}):
      raise SystemExit(f"--reference {spec}: no model {name!r} in {path} "
                       f"(it has {sorted(report.get('models', {}))})")
    theirs = report.get("subcorpora", {}).get("C0", {})
    ours = subcorpora.get("C0", {}).get("meta", {})
    differ = [f for f in fields if theirs.get(f) != ours.get(f)]
    if report.get("questions") != questions or differ or not ours:
      raise SystemExit(f"--reference {spec}: {path} was made on other dev questions "
                       f"({report.get('questions')} vs {questions} questions; C0 differs in "
                       f"{differ or ['(no C0 here)']}): no paired test")
    found[name] = {**report["models"][name], "reference": path}
  return found


def equal_size_pairs(tokens: dict[str, int]) -> list[tuple[str, str]]:
  """(R_r, the H_k closest to it in index size) for every random subcorpus."""
  hard = [k for k in tokens if k.startswith("H")]
  return [(r, min(hard, key=lambda h: abs(tokens[h] - tokens[r])))
          for r in tokens if r.startswith("R") and hard]


def hard_builder(subcorpora: dict, fingerprints: dict[str, str]) -> str | None:
  """The model whose retrieval built the H_k subcorpora (its dump's phrase-encoder fingerprint is
  theirs), if it is one of the evaluated models."""
  built = {m["meta"].get("fingerprint") for k, m in subcorpora.items() if k.startswith("H")}
  return next((name for name, fp in fingerprints.items() if fp in built), None)


def tau_table(models: dict, subcorpora: list[str]) -> dict:
  """{subcorpus: {metric: Kendall tau of its model ranking with the full corpus's}}."""
  full = {m: [r["subcorpora"]["full"][m] for r in models.values()] for m in METRICS}
  return {kind: {m: kendall_tau([r["subcorpora"][kind][m] for r in models.values()], full[m])
                 for m in METRICS}
          for kind in subcorpora}


def equal_size_table(tau: dict, tokens: dict[str, int]) -> list[str]:
  """The R_r vs H_k table; no lines when the subcorpora hold no such pair."""
  if not equal_size_pairs(tokens):
    return []
  lines = ["| random | tokens | tau EM@1 | tau Top-20 | hard | tokens | tau EM@1 | tau Top-20 | "
           "closer to the full ranking (EM@1) |", "|---|---|---|---|---|---|---|---|---|"]
  for r, h in equal_size_pairs(tokens):
    tr, th = tau[r], tau[h]
    verdict = ("n/a (no ranking: fewer than 2 models)" if np.isnan([tr["em@1"], th["em@1"]]).any()
               else "tie" if np.isclose(tr["em@1"], th["em@1"]) else
               h if th["em@1"] > tr["em@1"] else r)
    lines.append(f"| {r} | {tokens[r]:,} | {tr['em@1']:.3f} | {tr['top20']:.3f} | {h} | "
                 f"{tokens[h]:,} | {th['em@1']:.3f} | {th['top20']:.3f} | {verdict} |")
  return lines


def findings(results: dict) -> list[str]:
  """The two questions of the issue, answered from the figures (no hand-written claims)."""
  models = results["models"]
  first = next(iter(models.values()))["subcorpora"]
  tokens = {k: v["tokens"] for k, v in first.items()}
  lines = ["## Findings"]
  table = equal_size_table(results["tau"], tokens)
  if table:  # subcorpora without a hard/random pair: model comparisons only
    lines += ["", "Hard vs random subcorpora of (about) equal size: Kendall tau with the "
              "full-corpus ranking of the models (higher = ranks the models more like the full "
              "corpus).", ""] + table
  builder = results.get("hard_builder")
  if builder:
    own = models[builder]["subcorpora"]
    hard = [k for k in own if k.startswith("H")]
    same = all(np.isclose(own[k]["em@1"], own["full"]["em@1"]) for k in hard)
    figures = ", ".join(f"{k} {own[k]['em@1']:.2f}" for k in hard)
    lines += ["", f"The H_k were built from {builder}'s own retrieval (its dump's encoder "
              "fingerprint is the subcorpora's): its top-k phrases are in every H_k by "
              "construction, so its EM@1 on each H_k is its full-corpus EM@1 "
              f"({'so it is here: ' if same else 'NOT so here, which needs a look: '}"
              f"{figures}; "
              f"full {own['full']['em@1']:.2f}), while the other models' H_k figures overstate "
              "theirs. The same comparison without it:", ""]
    without = results.get("tau_without_builder")
    if not without:
      lines.append("(fewer than 3 other models: no ranking to compare)")
    else:
      lines += equal_size_table(without, tokens) or [
          "(no random and hard subcorpus of about equal size: the tau table's "
          f"\"without {builder}\" columns)"]
  if results.get("compare"):
    lines += ["", "Model comparisons on the full corpus (paired over the same questions; "
              "McNemar's exact test on the questions only one of the two gets right"
              + (f"; {', '.join(results['references'])} from an earlier report of the same "
                 "questions" if results.get("references") else "") + "):", "",
              "| A vs B | EM@1 A | EM@1 B | diff | A only / B only | p | Top-20 A | Top-20 B | "
              "diff | A only / B only | p |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    every = {**results.get("references", {}), **models}
    for a, b in results["compare"]:
      fa, fb = every[a]["subcorpora"]["full"], every[b]["subcorpora"]["full"]
      cells = []
      for metric in ("em@1", "top20"):
        a_only, b_only, p = mcnemar_p(fa["hits"][metric], fb["hits"][metric])
        cells.append(f"{fa[metric]:.2f} | {fb[metric]:.2f} | {fa[metric] - fb[metric]:+.2f} | "
                     f"{a_only} / {b_only} | {p_text(p)}")
      lines.append(f"| {a} vs {b} | " + " | ".join(cells) + " |")
  return lines


def markdown(results: dict, command: str) -> str:
  models = results["models"]
  kinds = list(next(iter(models.values()))["subcorpora"])
  lines = ["# Validation on hard subcorpora (Kim et al. 2022, Figure 2) at our scale", "",
           f"Command: `{command}`", "",
           f"{results['questions']} dev questions (`{results['questions_file']}`); corpus of "
           f"{results['corpus_passages']} passages; exact (Flat) indexes over subsets of each "
           "model's full dump.", "",
           "## EM@1 (phrase) by subcorpus", "",
           "| model | step | RC EM | " + " | ".join(
               f"{k} ({models[next(iter(models))]['subcorpora'][k]['tokens']:,} tok)"
               for k in kinds) + " |",
           "|---|---|---|" + "---|" * len(kinds)]
  for name, m in models.items():
    lines.append(f"| {name} | {m['step']} | {m['rc_em']:.2f} | " + " | ".join(
        f"{m['subcorpora'][k]['em@1']:.2f}" for k in kinds) + " |")
  lines += ["", "## Passage Top-20 by subcorpus", "",
            "| model | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
  for name, m in models.items():
    lines.append(f"| {name} | " + " | ".join(f"{m['subcorpora'][k]['top20']:.2f}"
                                             for k in kinds) + " |")
  without, builder = results.get("tau_without_builder"), results.get("hard_builder")
  extra = [f"without {builder}: tau ({m})" for m in ("em@1", "top20")] if without else []
  lines += ["", "## Kendall tau with the full-corpus ranking of the models", "",
            "| subcorpus | tokens | " + " | ".join([f"tau ({m})" for m in METRICS] + extra) + " |",
            "|---|---|" + "---|" * (len(METRICS) + len(extra))]
  for kind in kinds:
    tokens = models[next(iter(models))]["subcorpora"][kind]["tokens"]
    cells = [results["tau"][kind][m] for m in METRICS]
    cells += [without[kind][m] for m in ("em@1", "top20")] if without else []
    lines.append(f"| {kind} | {tokens:,} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
  from experiments.report import with_notes
  return with_notes(lines + [""] + findings(results), results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--model", action="append", required=True, help="NAME=WORKDIR[@STEP]")
  parser.add_argument("--subcorpora", required=True, help="a `run.py subcorpus` output folder")
  parser.add_argument("--out", required=True, help="results JSON (the .md goes beside it)")
  parser.add_argument("--compare", action="append", default=[],
                      help="A:B, two --model names: paired EM@1 / Top-20 test of A vs B")
  parser.add_argument("--reference", action="append", default=[],
                      help="FILE:MODEL, a model of an earlier report of this script on the same "
                           "dev questions, to name in --compare (full-corpus hits only)")
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph printed after the tables (e.g. the conclusions)")
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)
  from dpjax.config import setup_logging
  setup_logging("dpjax.checkpoint", fmt="%(asctime)s %(message)s")

  from dpjax.config import load_config
  from dpjax.data.corpus import read_corpus
  from dpjax.data import Tokenizer, load_rc_split
  from dpjax.data.questions import read_questions
  from dpjax.loading import data_paths
  from dpjax.parallel import make_mesh, round_to_devices
  from dpjax.settings import Settings

  config = Settings.of(load_config(args.config, args.set))
  specs = [parse_model(m) for m in args.model]
  compare = [tuple(c.split(":", 1)) for c in args.compare]
  names = {name for name, _, _ in specs} | {r.rpartition(":")[2] for r in args.reference}
  for pair in compare:
    if len(pair) != 2 or not set(pair) <= names:
      raise SystemExit(f"--compare {':'.join(pair)}: expected A:B, two of {sorted(names)}")
  paths = data_paths(config.data, config.index, specs[0][1])
  corpus = list(read_corpus(paths["corpus"]))
  subcorpora = load_subcorpora(pathlib.Path(args.subcorpora), corpus)
  dev_file = questions_file(subcorpora, paths["questions"])
  questions = read_questions(dev_file)[:config.eval.limit or None]
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  rc_split = load_rc_split(dev_file, tokenizer, config.data, limit=config.eval.limit or None)
  references = load_references(args.reference, subcorpora, len(questions))
  if set(references) & {name for name, _, _ in specs}:
    raise SystemExit(f"--reference {sorted(set(references) & names)}: also a --model name")
  key = cache_key(subcorpora, questions, config)
  mesh = make_mesh()
  batch_size = round_to_devices(config.index.batch_size, mesh)
  models = {name: evaluate_model(config, name, workdir, step, corpus, subcorpora, questions,
                                 rc_split, tokenizer, mesh, batch_size, key)
            for name, workdir, step in specs}
  for result in models.values():  # cached figures keep their own order
    result["subcorpora"] = dict(sorted(result["subcorpora"].items(),
                                       key=lambda item: subcorpus_order(item[0])))
  kinds = list(next(iter(models.values()))["subcorpora"])
  tau = tau_table(models, kinds)
  builder = hard_builder(subcorpora, {
      name: dump_fingerprint(pathlib.Path(r["workdir"]), r["step"], dump_dtype(config))
      for name, r in models.items()})
  others = {name: r for name, r in models.items() if name != builder}
  tau_without = tau_table(others, kinds) if builder and len(others) >= 3 else None
  results = {"config": args.config, "overrides": args.set, "questions": len(questions),
             "questions_file": dev_file,
             "corpus_passages": len(corpus),
             "subcorpora": {k: v["meta"] for k, v in subcorpora.items()},
             "models": models, "tau": tau, "hard_builder": builder,
             "tau_without_builder": tau_without, "compare": compare,
             "references": references, "notes": args.note}
  from experiments.report import elide_notes, save_results
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  save_results(args.out, results, markdown, "experiments/studies/validation_experiment.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
