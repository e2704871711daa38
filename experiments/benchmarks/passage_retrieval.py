"""Passage retrieval side by side (SQuAD-open small): dpjax phrase-based passage retrieval vs BM25
vs an off-the-shelf dense passage retriever, on the same passages, questions and answer matching.

  python experiments/benchmarks/passage_retrieval.py --config experiments/squad.py:cpu \\
      --workdir workdirs/squad-cpu-unified --out results/peers.json

Systems (all retrieve from the passages of the workdir's dump: the 20,958 unique SQuAD train+dev
paragraphs; all are scored by `dpjax.metrics.passage_scores`, normalised token-sequence answer
match):
  dpjax-<index>  phrase-based passage retrieval (a passage scores as its best phrase), for every
                 index in --indexes (default Flat and IVFauto_SQ4), plus phrase EM@1/EM@10;
                 with `--set index.sparse=True` hybrid search, named dpjax-<index>-hybrid
                 (the config's search options apply: `dpjax.loading.search_options`);
  bm25           bm25s, k1 0.9 and b 0.4 (Pyserini's defaults), English stop words, the Snowball
                 English (Porter2) stemmer of PyStemmer (Pyserini: Lucene's Porter), over
                 "title text";
  dense-minilm   all-MiniLM-L6-v2 as sentence-transformers uses it: mean of the last hidden
                 states over the tokens, L2-normalised, passages cut at 256 tokens, through
                 dpjax's own BERT; faiss IndexFlatIP.
Writes the JSON and a Markdown table (`--out` with .md) with the command. `--merge A.json ...`
keeps the systems of earlier runs on the same passages and questions that this run does not
measure (e.g. BM25 and the dense peer, which do not depend on the phrase model, beside a newer
model's dpjax rows, or runs made side by side on two cores; a system in several tables is taken
from the last one); each row names the command and, for dpjax, the workdir that produced it.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

KS = (1, 5, 20, 100)


def bm25_retrieve(passages, questions, k: int,
                  ) -> tuple[list[list[int]], list[list[float]], dict]:
  """(the top-k passage rows [Q][k], their BM25 scores [Q][k], how it ran) of BM25 over the
  passages, with the settings of dpjax's BM25 index (`dpjax.index.sparse.SETTINGS`)."""
  from dpjax.index.sparse import SETTINGS, bm25_of, passage_text, tokenize
  start = time.perf_counter()
  retriever = bm25_of([passage_text(p) for p in passages])
  built = time.perf_counter() - start
  start = time.perf_counter()
  rows, scores = retriever.retrieve(tokenize(questions), k=k, show_progress=False)
  seconds = time.perf_counter() - start
  return rows.tolist(), scores.tolist(), {
      "index_seconds": built, "questions_per_sec": len(questions) / seconds,
      "stemmer": SETTINGS["stemmer"], "k1": SETTINGS["k1"], "b": SETTINGS["b"]}


def mean_pooled(model, tokenizer, texts, max_len: int, batch_size: int, mesh) -> np.ndarray:
  """sentence-transformers' all-MiniLM-L6-v2 embedding: masked mean, L2-normalised."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from dpjax.parallel import map_batches

  graphdef, state = nnx.split(model)

  @jax.jit
  def embed(state, ids, mask):
    hidden = nnx.merge(graphdef, state)(ids, mask)
    weights = mask[..., None].astype(jnp.float32)
    pooled = (hidden * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

  ids, mask = tokenizer.encode(list(texts), max_len)
  out = np.zeros((len(texts), model.config.hidden_size), np.float32)
  # Length-bucketed batches: no compute on padding (map_batches undoes the order via `rows`).
  for rows, vectors in map_batches(lambda i, m: embed(state, i, m), [ids, mask], batch_size,
                                   mesh, lengths=mask.sum(1)):
    out[rows] = vectors
  return out


def dense_retrieve(passages, questions, k: int, mesh, batch_size: int):
  import faiss

  from dpjax.data import Tokenizer
  from dpjax.models.pretrained import load_pretrained_bert
  model = load_pretrained_bert("minilm-l6")
  tokenizer = Tokenizer.from_pretrained("minilm-l6")
  start = time.perf_counter()
  passage_vectors = mean_pooled(model, tokenizer, [f"{p.title} {p.text}" for p in passages], 256,
                                batch_size, mesh)
  encoded = time.perf_counter() - start
  index = faiss.IndexFlatIP(passage_vectors.shape[1])
  index.add(passage_vectors)
  start = time.perf_counter()
  question_vectors = mean_pooled(model, tokenizer, questions, 64, batch_size, mesh)
  _, rows = index.search(question_vectors, k)
  seconds = time.perf_counter() - start
  return rows.tolist(), {"passage_encoding_seconds": encoded,
                         "questions_per_sec": len(questions) / seconds}


DPR_MATCH = "DPR's `has_answer`"
# How passages were matched to answers by runs made before `metrics.has_answer` became DPR's.
OLD_MATCH = ("SQuAD-normalised token-sequence match, dpjax's before 2026-11-27; DPR's `has_answer`,"
             " used since, counts +0.65 Top-20 on SQuAD dev: `results/has_answer.md`")


def table(results: dict, command: str) -> str:
  commands = results.get("commands") or [command]
  lines = ["# Passage retrieval side by side: SQuAD-open small", "",
           "Command" + ("s (rows: see `measured by`): " if len(commands) > 1 else ": ")
           + "; ".join(f"`{c}`" for c in commands)
           + (f"; one table by `{results['merged_by']}`" if "merged_by" in results else ""), "",
           f"{results['questions']} SQuAD dev questions, {results['passages']} passages (the unique "
           "SQuAD train + dev paragraphs), one answer-matching function for all systems "
           f"({results.get('answer_match', OLD_MATCH)}, `dpjax.metrics.passage_scores`).", "",
           "| system | " + " | ".join(f"Top-{k}" for k in KS) + " | MRR@20 | P@20 | phrase EM@1 | "
           "questions/s |" + (" measured by |" if len(commands) > 1 else ""),
           "|---|" + "---|" * (len(KS) + 4 + (len(commands) > 1))]
  for name, r in results["systems"].items():
    s = r["scores"]
    lines.append(f"| {name} | " + " | ".join(f"{s[f'top{k}']:.2f}" for k in KS)
                 + f" | {s['mrr@20']:.2f} | {s['p@20']:.2f} | "
                 + (f"{r['em@1']:.2f}" if "em@1" in r else "-")
                 + f" | {r['questions_per_sec']:.1f} |"
                 + (f" command {commands.index(r['command']) + 1}"
                    + (f", `{r['workdir']}`" if "workdir" in r else "") + " |"
                    if len(commands) > 1 else ""))
  from experiments.report import with_notes
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, help="a workdir with a dump and its indexes")
  parser.add_argument("--indexes", nargs="+", default=["Flat", "IVFauto_SQ4"])
  parser.add_argument("--systems", nargs="*", default=["dpjax", "bm25", "dense-minilm"],
                      choices=["dpjax", "bm25", "dense-minilm"],
                      help="the systems this run measures (none: only --merge tables)")
  parser.add_argument("--out", required=True)
  parser.add_argument("--merge", nargs="*", metavar="TABLE", default=None,
                      help="keep the systems of earlier runs (those in --out, or in the TABLEs "
                      "given) on the same passages and questions that this run does not measure; "
                      "a system in several TABLEs is taken from the last one")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--note", action="append", default=[],
                      help="a paragraph under the table (kept by --merge unless given again)")
  args = parser.parse_args(argv)
  if not args.systems and args.merge is None:
    parser.error("nothing to do: no --systems to measure and no --merge tables")
  from experiments.report import command_line, elide_notes
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  command = command_line("experiments/benchmarks/passage_retrieval.py", argv)
  from dpjax.config import setup_logging
  setup_logging("dpjax.checkpoint", fmt="%(asctime)s %(message)s")

  from dpjax import metrics
  from dpjax.data import Tokenizer
  from dpjax.loading import search_options
  from dpjax.main import open_workdir, restore
  from dpjax.parallel import make_mesh, round_to_devices
  from dpjax.index.phrase_index import PhraseIndex
  from dpjax.index.search import PhraseSearcher

  config, workdir, dump, questions = open_workdir(args.config, args.workdir, args.set)
  passages = dump.passages
  questions = questions[:config.eval.limit or None]
  texts = [q.question for q in questions]
  answers = [q.answers for q in questions]
  mesh = make_mesh()
  batch = round_to_devices(config.index.batch_size, mesh)
  fingerprint = _fingerprint(texts, passages)
  earlier = _earlier_tables(args, len(questions), len(passages), fingerprint)
  k = min(max(KS), len(passages))
  score = lambda rows: metrics.passage_scores([[passages[i].text for i in r if i >= 0]
                                               for r in rows], answers, ks=KS)
  systems = {}
  if "dpjax" in args.systems:
    model, step = restore(config, workdir)
    tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
    for index in args.indexes:
      name = index + ("-hybrid" if config.index.sparse else "")
      phrase_index = PhraseIndex(dump, index, nprobe=config.index.nprobe,
                                 **search_options(config.index, dump))
      searcher = PhraseSearcher(model, phrase_index, tokenizer,
                              max_query_length=config.data.max_query_length, batch_size=batch,
                              mesh=mesh)
      start = time.perf_counter()
      found, phrases = searcher.search_many(texts, [(k, "passage"), (10, "phrase")],
                                            max_answer_length=config.eval.max_answer_length)
      seconds = time.perf_counter() - start  # passages and top-10 phrases, one index search
      systems[f"dpjax-{name}"] = {
          "scores": score([[r["passage_row"] for r in res] for res in found]),
          **metrics.open_domain_scores([[r["answer"] for r in res] for res in phrases], answers),
          "questions_per_sec": len(texts) / seconds, "model_step": step,
          "workdir": str(workdir)}
      logging.info("dpjax-%s: %s", name, systems[f"dpjax-{name}"]["scores"])
  if "bm25" in args.systems:
    rows, _, info = bm25_retrieve(passages, texts, k)
    systems["bm25"] = {"scores": score(rows), **info}
    logging.info("bm25: %s", systems["bm25"]["scores"])
  if "dense-minilm" in args.systems:
    rows, info = dense_retrieve(passages, texts, k, mesh, batch)
    systems["dense-minilm"] = {"scores": score(rows), **info}
    logging.info("dense-minilm: %s", systems["dense-minilm"]["scores"])
  for info in systems.values():
    info["command"] = command
  kept = {name: info for name, info in earlier["systems"].items() if name not in systems}
  order = ["dpjax", "bm25", "dense-minilm"]  # dpjax rows first, then the peers
  systems = dict(sorted({**systems, **kept}.items(),
                        key=lambda item: next(i for i, s in enumerate(order)
                                              if item[0].startswith(s))))
  commands = list(dict.fromkeys([*earlier["commands"], command]))  # in the order they ran
  results = {"questions": len(questions), "passages": len(passages),
             "answer_match": DPR_MATCH, "fingerprint": fingerprint, "systems": systems,
             "commands": [c for c in commands if any(i["command"] == c for i in systems.values())],
             "notes": args.note or earlier["notes"]}
  if not args.systems:
    results["merged_by"] = command
  from experiments.report import save_results
  save_results(args.out, results, table, "experiments/benchmarks/passage_retrieval.py", argv)
  return 0


def _fingerprint(questions: list[str], passages) -> str:
  """Identifies the questions and passages a table was measured on (for --merge)."""
  import hashlib
  digest = hashlib.sha256()
  for text in [*questions, "", *(f"{p.title}\t{p.text}" for p in passages)]:
    digest.update(text.encode() + b"\n")
  return digest.hexdigest()[:16]


def _earlier_tables(args, questions: int, passages: int, fingerprint: str) -> dict:
  """The systems (each with the command that measured it) and notes of the earlier tables for
  --merge, a system in several tables taken from the last one; refuses a table of other
  passages/questions (by fingerprint; by their numbers for tables written before fingerprints)."""
  import json
  if args.merge is None:
    return {"systems": {}, "notes": [], "commands": []}
  paths = [pathlib.Path(t) for t in args.merge]
  missing = [str(p) for p in paths if not p.is_file()]
  if missing:
    raise SystemExit(f"--merge: no such table: {', '.join(missing)}")
  paths = paths or [p for p in [pathlib.Path(args.out)] if p.is_file()]
  systems, notes, commands = {}, [], []
  for path in paths:
    try:
      table = json.loads(path.read_text())
      found = table["systems"]
      same = ((table["questions"], table["passages"]) == (questions, passages)
              and table.get("fingerprint", fingerprint) == fingerprint)
      fallback = (table.get("commands") or [_md_command(path)])[0]
    except (ValueError, KeyError, TypeError) as e:
      raise SystemExit(f"{path}: not a passage_retrieval table that --merge can extend "
                       f"({type(e).__name__}: {e})")
    if found and table.get("answer_match") != DPR_MATCH:
      raise SystemExit(f"{path}: its rows matched passages to answers the old way ({OLD_MATCH}); "
                       "--merge would mix two definitions in one table: measure them again")
    if not same:
      raise SystemExit(f"{path} has {table['questions']} questions / {table['passages']} "
                       f"passages (fingerprint {table.get('fingerprint')}), this run "
                       f"{questions} / {passages} ({fingerprint}): --merge would mix two setups "
                       "in one table")
    for name, info in found.items():
      systems.pop(name, None)  # the later table's row, in the later table's place
      systems[name] = {"command": fallback, **info}
    commands += table.get("commands") or [fallback]  # in the order its rows were measured
    notes = notes or table.get("notes", [])
  return {"systems": systems, "notes": notes, "commands": commands}


def _md_command(path: pathlib.Path) -> str:
  """The command in the Markdown report beside a table written before tables recorded theirs."""
  import re
  md = path.with_suffix(".md")
  match = re.search(r"^Command: `([^`]+)`", md.read_text(), re.M) if md.is_file() else None
  return match.group(1) if match else f"(not recorded in {path})"


if __name__ == "__main__":
  sys.exit(main())
