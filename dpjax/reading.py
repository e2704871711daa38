"""The retriever-reader pipeline of `run.py eval` (`eval.reader`).

The cross-encoder reader of `run.py teacher` (in the workdir `eval.reader`, with the model and
windows that workdir saved) reads each question's top `eval.reader_passages` passages of the
phrase index's passage ranking, and answers as BERTserini (Yang et al. 2019) does
(`rc.mixed_answers`): the best span of the passage with the highest (1 - mu) x the retriever's
score of it + mu x the reader's score of its best span. The reader's scores alone are not
comparable across passages (it was trained on windows that hold the answer), hence the mix. mu is
`eval.reader_mu`, or, unset, chosen from `MU_GRID` by EM@1 on `eval.reader_tune_questions` random
training questions (seeded; never the evaluation's), every mu's EM@1 recorded.
"""
from __future__ import annotations

import logging
import pathlib
import time

import numpy as np

from dpjax import metrics
from dpjax.config import SAVED_CONFIG, workdir_config
from dpjax.data import Tokenizer, data_files
from dpjax.data.questions import read_questions, sample_questions
from dpjax.errors import ConfigError
from dpjax.layout import Workdir
from dpjax.parallel import make_mesh, round_to_devices
from dpjax.rc import mixed_answers, read_retrieved_passages, restore_reader

log = logging.getLogger(__name__)

# Only the ratio mu / (1 - mu) of the reader's weight to the retriever's moves the argmax, and
# the two scores have scales of their own, so the ratio doubles from 1/64 to 64 (an even grid in
# mu would hold only 1/9 to 9); the retriever alone (0) and the reader alone (1) are in it.
MU_GRID = (0.0, *(round(2.0 ** j / (1 + 2.0 ** j), 4) for j in range(-6, 7)), 1.0)
TUNE_SEED = 17  # the training questions mu is chosen on (as `dpjax.fusion`'s hybrid weight)


def em_hits(predictions, answers) -> str:
  """Per question, whether its one answer (None: none) matches a gold one, as a 0/1 string."""
  return "".join(str(int(p is not None and metrics.max_over_gold(metrics.exact_match, p, g) > 0))
                 for p, g in zip(predictions, answers))


def em_at_1(found, answers) -> float:
  """EM@1 (x100) of `rc.ReadAnswer`s (None: no answer)."""
  hits = em_hits([a.text if a else None for a in found], answers)
  return 100.0 * hits.count("1") / max(len(answers), 1)


def median_spread(per_passage, retriever_scores) -> dict:
  """The median over questions of the range (max - min) of the retriever's and of the reader's
  scores over the passages read: the two scales mu weighs against each other."""
  spreads = {"retriever": [], "reader": []}
  for spans, scores in zip(per_passage, retriever_scores):
    read = [(r, a.score) for a, r in zip(spans, scores) if a is not None]
    if len(read) > 1:
      for name, values in zip(spreads, zip(*read)):
        spreads[name].append(max(values) - min(values))
  return {name: float(np.median(v)) if v else None for name, v in spreads.items()}


def choose_mu(per_passage, retriever_scores, answers) -> dict:
  """The mu of `MU_GRID` with the best EM@1 of `rc.mixed_answers` on held-out questions (ties
  to the smaller mu), with every mu's EM@1 and the scores' spreads."""
  scores = {mu: em_at_1(mixed_answers(per_passage, retriever_scores, mu), answers)
            for mu in MU_GRID}
  best = max(MU_GRID, key=lambda mu: (scores[mu], -mu))
  return {"mu": best, "em@1": {str(mu): em for mu, em in scores.items()},
          "median_spread": median_spread(per_passage, retriever_scores)}


class Reader:
  """`eval.reader`'s reader, ready to read the passages a phrase index ranked."""

  def __init__(self, config):
    workdir = pathlib.Path(config.eval.reader)
    # The reader's own model and windows: those its workdir saved (else this run's config).
    self.config = (workdir_config(None, [], workdir) if (workdir / SAVED_CONFIG).is_file()
                   else config)
    self.model, self.step = restore_reader(self.config, workdir)
    self.tokenizer = Tokenizer.from_pretrained(self.config.model.tokenizer)
    self.mesh = make_mesh()
    self.batch_size = round_to_devices(config.eval.batch_size, self.mesh)
    self.max_answer_length = config.eval.max_answer_length

  def read(self, texts, passages, rows):
    """The reader's best span in each passage of `rows` [Q][k] (`rc.read_retrieved_passages`)."""
    return read_retrieved_passages(self.model, self.tokenizer, self.config.data, texts, passages,
                                   rows, mesh=self.mesh, batch_size=self.batch_size,
                                   max_answer_length=self.max_answer_length)


def check_reader_config(config, workdir) -> None:
  """Refuses `eval.reader` settings no run can use, before any work."""
  mu = config.eval.reader_mu
  if mu is not None and not 0.0 <= mu <= 1.0:
    raise ConfigError(f"eval.reader_mu {mu}: the reader's weight is in [0, 1]")
  if config.eval.passage_k < config.eval.reader_passages:
    raise ConfigError(f"eval.reader_passages {config.eval.reader_passages} is more than "
                      f"eval.passage_k {config.eval.passage_k}, the passages ranked")
  if config.eval.regex:
    raise ConfigError("eval.reader with eval.regex: the reader's answers are scored as text "
                      "(SQuAD EM), not against regular expressions")
  if not pathlib.Path(config.eval.reader).is_dir():
    raise ConfigError(f"eval.reader {config.eval.reader}: no such workdir (one holding a "
                      "`run.py teacher` reader)")
  checkpoints = Workdir(config.eval.reader).teacher.checkpoints()
  if not checkpoints.is_dir():
    raise ConfigError(f"eval.reader {config.eval.reader}: no reader checkpoint in {checkpoints} "
                      "(train one with `run.py teacher`)")
  train = data_files(config.data, workdir).get("train")
  if mu is None and not (train and pathlib.Path(train).is_file()):
    raise ConfigError(f"eval.reader_mu is unset and there are no training questions ({train}) "
                      "to choose it on: set eval.reader_mu")


def ranked_passages(found_passages, k: int) -> tuple[list[list[int]], list[list[float]]]:
  """(the top-k passage rows [Q][k], their scores) of the index's passage ranking."""
  top = [units[:k] for units in found_passages]
  return ([[unit.passage for unit, _ in units] for units in top],
          [[unit.score for unit, _ in units] for units in top])


def tuned_mu(config, workdir, reader: Reader, searcher, evaluated: set[str]) -> dict:
  """mu chosen on `eval.reader_tune_questions` random training questions (none of the
  `evaluated` ids), searched by `searcher` as the evaluation's are (`choose_mu`), with a record
  of the questions."""
  path = data_files(config.data, workdir)["train"]
  questions = sample_questions([q for q in read_questions(path) if q.id not in evaluated],
                               config.eval.reader_tune_questions, TUNE_SEED)
  texts = [q.question for q in questions]
  # ranked as the evaluation ranks: its passage_k, then the first reader_passages
  found = searcher.search(texts, k=config.eval.passage_k, unit="passage",
                          max_answer_length=config.eval.max_answer_length)
  top = [results[:config.eval.reader_passages] for results in found]
  rows = [[r["passage_row"] for r in results] for results in top]
  scores = [[r["score"] for r in results] for results in top]
  choice = choose_mu(reader.read(texts, searcher.index.dump.passages, rows), scores,
                     [q.answers for q in questions])
  log.info("reader mu %g chosen on %d questions of %s", choice["mu"], len(questions), path)
  return {**choice, "questions": len(questions), "file": str(path), "seed": TUNE_SEED,
          "criterion": "EM@1, ties to the smaller mu"}


def read_answers(config, workdir, searcher, questions, found_passages,
                 search_seconds: float) -> tuple[dict, list[str | None]]:
  """(the report's "reader" record, each question's answer) of the pipeline over the passages
  the evaluation's search ranked (`found_passages`: its passage units per question)."""
  reader = Reader(config)
  k = config.eval.reader_passages
  if config.eval.reader_mu is None:
    tuning = tuned_mu(config, workdir, reader, searcher, {q.id for q in questions})
    mu = tuning["mu"]
  else:
    tuning, mu = {"set": "eval.reader_mu"}, config.eval.reader_mu
  texts, answers = [q.question for q in questions], [q.answers for q in questions]
  rows, scores = ranked_passages(found_passages, k)
  start = time.perf_counter()
  found = mixed_answers(reader.read(texts, searcher.index.dump.passages, rows), scores, mu)
  seconds = time.perf_counter() - start
  predictions = [a.text if a else None for a in found]
  hits = em_hits(predictions, answers)
  record = {"workdir": str(config.eval.reader), "step": reader.step, "passages": k, "mu": mu,
            "mu_tuning": tuning,
            **metrics.open_domain_scores([[p] if p is not None else [] for p in predictions],
                                         answers, ks=(1,)),
            "hits": {"em@1": hits}, "reading_seconds": seconds,
            "questions_per_sec": len(questions) / (search_seconds + seconds)}
  log.info("reader over the top %d passages (mu %g): EM@1 %.2f; %.1f questions/s with the "
           "search", k, mu, record["em@1"], record["questions_per_sec"])
  return record, predictions
