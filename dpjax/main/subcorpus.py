"""`run.py subcorpus`: the validation subcorpora C0, R_r, H_k of the corpus written to
workdir/subcorpora/ with their metadata.
"""
from __future__ import annotations

from dpjax.data.corpus import read_corpus
from dpjax.data.questions import read_questions, sample_questions
from dpjax.data.squad import SkipSummary, write_squad_subset
from dpjax.errors import DataError
from dpjax.index.dump_reader import Dump
from dpjax.index.manifest import MANIFEST
from dpjax.workdir import Workdir
from dpjax.validation import gold_rows, parse_kind, select, subcorpus_tokens, write_subcorpus
from dpjax.loading import data_paths
from dpjax.main import open_searcher, writes_to
from dpjax.settings import Settings


@writes_to
def run(settings: Settings, workdir: Workdir) -> dict:
  """Writes the validation subcorpora `validation.kinds` (C0, R<r>, H<k>, full) of the corpus to
  workdir/subcorpora/<kind>.jsonl with their metadata; H_k uses the model and the full index."""
  kinds = list(settings.validation.kinds)
  hard_ks = [int(v) for n, v in map(parse_kind, kinds) if n == "H"]
  paths = data_paths(settings.data, settings.index, workdir)
  out = workdir.subcorpora
  questions_file = paths["questions"]
  if settings.validation.sample_questions:
    # A seeded random sample of the dev questions (the first N come from a few articles only).
    sample = sample_questions(read_questions(questions_file), settings.validation.sample_questions,
                              settings.validation.seed)
    # One file per sample: a later run with another sample leaves earlier subcorpora theirs.
    questions_file = str(out / f"questions_n{settings.validation.sample_questions}_seed"
                               f"{settings.validation.seed}.json")
    write_squad_subset(paths["questions"], questions_file, [q.id for q in sample])
  summary = SkipSummary()
  corpus = list(read_corpus(paths["corpus"], summary))
  c0 = gold_rows(corpus, questions_file)
  dump = Dump.load(paths["dump"]) if (paths["dump"] / MANIFEST).is_file() else None
  if dump is not None and [p.id for p in dump.passages] != [p.id for p in corpus]:
    raise DataError(f"{paths['dump']} is not a dump of the configured corpus "
                    f"({len(dump.passages)} vs {len(corpus)} passages, or another order)")
  retrieved, provenance = None, {"corpus": paths["corpus"], "questions": questions_file,
                                 "sample_questions": settings.validation.sample_questions,
                                 "seed": settings.validation.seed}
  if hard_ks:
    if dump is None:
      raise DataError(f"H_k needs the full dump and index of the corpus in {paths['dump']} "
                      "(run `run.py dump` and `run.py index` first)")
    searcher, _ = open_searcher(settings, workdir)
    texts = [q.question for q in read_questions(questions_file)]
    found = searcher.search(texts, k=max(hard_ks), unit="phrase",
                            max_answer_length=settings.eval.max_answer_length)
    retrieved = [[r["passage_row"] for r in results] for results in found]
    provenance.update(index=settings.index.search_index,
                      model_step=searcher.index.dump.manifest["model"].get("step"),
                      fingerprint=searcher.index.fingerprint)
  written = {}
  for kind in kinds:
    rows = select(kind, len(corpus), c0, retrieved, settings.validation.seed)
    meta = {"kind": kind, **provenance}
    if dump is not None:
      meta["tokens"] = subcorpus_tokens(dump.token_passage, rows)
    written[kind] = write_subcorpus(out / f"{kind}.jsonl", corpus, rows, meta)
    print(f"{kind}: {written[kind]['passages']} passages"
          + (f", {meta['tokens']} tokens" if "tokens" in meta else "") + f" -> {out / kind}.jsonl")
  return written
