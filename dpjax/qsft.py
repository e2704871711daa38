"""Query-side fine-tuning (DensePhrases Section 4.3; Kim et al. 2022): adapt the question encoders
to a fixed phrase index.

The phrase encoder and the index stay frozen (freezing by the config's parameter filter, the same
optimizer and jitted step as training, loss recipe `qsft`). At the start of every epoch the
current question encoders retrieve the top-k phrases of every training question from the index;
their start/end vectors are taken from the dump (exact) or reconstructed by the index's quantizer
(`qsft.quantized`: quantisation-aware training for IVF-SQ / (O)PQ indexes, and the only kind a
compact index, which holds codes alone, allows: its codes decoded). The loss is the
marginal likelihood of the candidates whose text matches a gold answer (`level=phrase`) or whose
document (title) is a gold document (`level=document`, L_doc), plus the same on start-only and
end-only scores. Questions without any positive candidate are left out of the epoch. Dev EM@1 over
the full index is measured before training and after every epoch; the best checkpoint is kept in
`workdir/checkpoints_qsft` (`run.py eval --set eval.checkpoint=qsft` uses it).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from typing import Sequence

import faiss
import jax
import jax.numpy as jnp
import numpy as np

from dpjax.checkpoint import Checkpointer
from dpjax.data import Tokenizer, data_files
from dpjax.errors import ConfigError, DataError
from dpjax.settings import (DataSettings, EvalSettings, IndexSettings, ModelSettings,
                            QsftSettings, TrainSettings, ValidationSettings,
                            section_dict)
from dpjax.data.questions import read_questions, sample_questions
from dpjax.index.evaluate import retrieval_scores
from dpjax.index.dump_reader import require_vectors
from dpjax.index.phrase_index import PhraseIndex
from dpjax import io, metrics
from dpjax.io import remove, write_json
from dpjax.workdir import Workdir
from dpjax.models.encoders import encode_questions
from dpjax.objectives import make_objective
from dpjax.parallel import batch_sharding, global_batch, local_rows, make_mesh, round_to_devices
from dpjax.trainer import Hook, MetricsWriter, Trainer, build_trainer, run_steps
from dpjax.loading import QSFT_METRIC, checked_dump, data_paths, restore_model

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Candidates:
  """Top-k retrieved phrases of Q questions."""

  start: np.ndarray  # [Q, K] token ids (-1: padding)
  end: np.ndarray  # [Q, K]
  valid: np.ndarray  # [Q, K] bool
  positive: np.ndarray  # [Q, K] bool


def retrieve_candidates(index, q_start: np.ndarray, q_end: np.ndarray, answers, *, k: int,
                        max_answer_length: int, level: str = "phrase",
                        gold_titles: Sequence[Sequence[str]] | None = None) -> Candidates:
  """The top-k phrases of each question and which of them are positives."""
  if level not in ("phrase", "document"):
    raise ValueError(f"qsft.level must be 'phrase' or 'document', not {level!r}")
  if level == "document" and gold_titles is None:
    raise ValueError("document-level QSFT needs the gold documents (titles) of the questions")
  found = index.search_phrases(q_start, q_end, k, max_answer_length=max_answer_length)
  shape = (len(found), k)
  out = Candidates(np.full(shape, -1, np.int64), np.full(shape, -1, np.int64),
                   np.zeros(shape, bool), np.zeros(shape, bool))
  for q, phrases in enumerate(found):
    golds = [metrics.normalize_answer(a) for a in answers[q]]
    for j, phrase in enumerate(phrases[:k]):
      out.start[q, j], out.end[q, j], out.valid[q, j] = phrase.start_token, phrase.end_token, True
      if level == "phrase":
        out.positive[q, j] = metrics.normalize_answer(phrase.text) in golds
      else:
        out.positive[q, j] = index.dump.passages[phrase.passage].title in gold_titles[q]
  return out


class CandidateVectors:
  """Token vectors of candidates: stored in the dump, or as the index's quantizer reconstructs
  them (an IVF index's `reconstruct`, a compact index's codes decoded: its search scores)."""

  def __init__(self, index, quantized: bool):
    self.index, self.quantized = index, quantized
    if index.compact is not None:
      if not quantized:
        raise ConfigError(f"qsft.index {index.manifest['spec']!r} is a compact index: it holds "
                          "codes, not the dump's vectors; set qsft.quantized=True to train on "
                          "the vectors its codes decode to")
    elif quantized:
      ivf = faiss.try_extract_index_ivf(index.index)
      if ivf is None:
        raise ConfigError(f"qsft.quantized: quantisation-aware QSFT needs an IVF index, not "
                         f"{index.manifest['resolved_spec']}")
      ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # reconstruct by label (token id)

  def __call__(self, ids: np.ndarray) -> np.ndarray:
    """[..., D] float32 vectors of token ids (zeros for -1)."""
    flat = ids.reshape(-1)
    safe = np.maximum(flat, 0)
    if self.quantized:  # (always, for a compact index: its ids are ranks, rows of its codes)
      unique, inverse = np.unique(safe, return_inverse=True)
      compact = self.index.compact
      rows = (compact.vectors.original(unique) if compact is not None
              else self.index.index.reconstruct_batch(unique))
      vectors = rows[inverse]
    else:
      vectors = self.index.dump.vectors[safe].astype(np.float32)
    vectors[flat < 0] = 0.0
    return vectors.reshape(*ids.shape, -1)


def _dev_scores(data: DataSettings, evaluation: EvalSettings, phrase_index, encoder, tokenizer,
                questions, mesh, batch_size) -> dict:
  """EM@k / F1@k of the top phrases of the dev questions over the full index."""
  q_start, q_end = encode_questions(encoder, tokenizer, [q.question for q in questions],
                                    max_query_length=data.max_query_length,
                                    batch_size=batch_size, mesh=mesh)
  return retrieval_scores(phrase_index, q_start, q_end, [q.answers for q in questions],
                          max_answer_length=evaluation.max_answer_length, top_tokens=10,
                          passage_k=0, regex=evaluation.regex, per_question=True)


def workdir_lock(path: pathlib.Path):
  """One QSFT run per workdir (`<workdir>/qsft.lock`): a second one would delete the first one's
  `checkpoints_qsft` and interleave its metrics."""
  return io.workdir_lock(path, "QSFT")


@dataclasses.dataclass(frozen=True)
class QsftRunSettings:
  """The config sections a QSFT run reads, built by its program (`run.py qsft`): the model it
  restores (the checkpoint `eval.checkpoint` names, `best` by `validation.metric`), its data and
  index, the training machinery it reuses, and the run's own `qsft`."""
  model: ModelSettings
  data: DataSettings
  train: TrainSettings
  evaluation: EvalSettings
  validation: ValidationSettings
  index: IndexSettings
  qsft: QsftSettings


@dataclasses.dataclass
class Setup:
  """What a QSFT run works with."""
  index: PhraseIndex
  vectors: CandidateVectors
  tokenizer: Tokenizer
  questions: list[dict]  # training questions
  dev: list[dict]
  ids: np.ndarray  # tokenised training questions
  mask: np.ndarray
  trainer: Trainer
  mesh: object
  trained_step: int | None
  first: object  # epoch 1's candidates (retrieved at the setup; dropped once trained on)
  train_config: object  # the QSFT training settings (`build_trainer`'s)
  objective: object
  steps: int = 0  # taken so far (the optimizer's count)


def epoch_schedule(peak: float, warmup_fraction: float, epochs: int, epoch: int, first: int,
                   steps: int):
  """The learning rate of QSFT epoch `epoch` (0-based, of `epochs`), whose `steps` steps start
  at the optimizer's count `first`: a linear warm-up over `warmup_fraction` of the run, then a
  linear decay to 0 at its end, by the run's progress (`epoch` + the share of its steps taken).
  An epoch steps over the questions with a positive among their candidates, which are retrieved
  anew each epoch, so the epochs' step counts are not known ahead: the decay follows progress."""
  warm = warmup_fraction * epochs

  def schedule(count):
    progress = epoch + (count - first) / max(steps, 1)
    rise = progress / warm if warm > 0 else 1.0
    return peak * jnp.clip(jnp.minimum(rise, (epochs - progress) / (epochs - warm)), 0.0, 1.0)
  return schedule


def _setup(settings: QsftRunSettings, workdir: Workdir) -> Setup:
  """The run's index, questions, tokenised questions, epoch 1's candidates and trainer (the
  restored model under the QSFT recipe and its freezing filter)."""
  qc, data = settings.qsft, settings.data
  paths = data_paths(data, settings.index, workdir)
  model, trained_step = restore_model(settings.model, data, settings.evaluation, workdir,
                                      best_metric=settings.validation.metric)
  manifest = checked_dump(data, settings.index, workdir, model)
  index = PhraseIndex(paths["dump"], qc.index, nprobe=settings.index.nprobe,
                      search_device=settings.index.search_device)
  if index.compact is None:  # (its candidates' exact vectors; a compact index decodes codes)
    require_vectors(manifest, paths["dump"], "run.py qsft")
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  train_file = qc.questions or str(data_files(data, workdir)["train"])
  questions = sample_questions(read_questions(train_file), qc.limit, qc.seed)
  dev = sample_questions(read_questions(paths["questions"]), qc.dev_limit, qc.seed)
  if qc.level == "document" and any(not q.title for q in questions):
    raise DataError(f"{train_file}: document-level QSFT needs gold titles (SQuAD format)")
  mesh = make_mesh()
  if qc.batch_size % mesh.size:
    raise ConfigError(f"qsft.batch_size {qc.batch_size} is not a multiple of {mesh.size} devices")
  ids, mask = tokenizer.encode([q.question for q in questions], data.max_query_length)
  # The training machinery with the QSFT recipe and its freezing filter.
  tc = dataclasses.replace(settings.train, batch_size=qc.batch_size,
                           learning_rate=qc.learning_rate, freeze=tuple(qc.freeze),
                           dropout=qc.dropout,
                           loss=dataclasses.replace(settings.train.loss, recipe="qsft"))
  first = _candidates(data, settings.evaluation, qc, index, model, tokenizer, questions, mesh)
  objective = make_objective(tc.loss, batch_size=qc.batch_size, length=1,
                             dim=model.config.hidden_size)
  trainer = build_trainer(model, tc, objective, mesh=mesh,
                          schedule=_schedule(tc, qc, 0, 0, _steps(first, qc)))
  return Setup(index, CandidateVectors(index, qc.quantized), tokenizer, questions, dev, ids, mask,
               trainer, mesh, trained_step, first, tc, objective)


def _steps(candidates, qc) -> int:
  """The steps of an epoch over these candidates: its questions with a positive, in batches."""
  return int(candidates.positive.any(1).sum()) // qc.batch_size


def _schedule(tc, qc, epoch: int, first: int, steps: int):
  # QSFT's warm-up is a fraction of its own run (train.warmup_steps counts the phrase run's).
  return epoch_schedule(qc.learning_rate, tc.warmup_fraction, qc.epochs, epoch, first, steps)


def _retrainer(run: Setup, qc, epoch: int, steps: int) -> Trainer:
  """The trainer of a later epoch: its learning rates (`epoch_schedule`, for its `steps`), the
  state trained so far (parameters, optimizer moments and count)."""
  trainer = build_trainer(run.trainer.model(), run.train_config, run.objective, mesh=run.mesh,
                          schedule=_schedule(run.train_config, qc, epoch, run.steps, steps))
  trainer.state = run.trainer.state
  return trainer


def _candidates(data: DataSettings, evaluation: EvalSettings, qsft: QsftSettings,
                phrase_index: PhraseIndex, encoder, tokenizer, questions, mesh):
  """The training questions' top-k candidates with `encoder`'s question encoders."""
  q_start, q_end = encode_questions(encoder, tokenizer, [q.question for q in questions],
                                    max_query_length=data.max_query_length,
                                    batch_size=round_to_devices(evaluation.batch_size, mesh),
                                    mesh=mesh)
  return retrieve_candidates(
      phrase_index, q_start, q_end, [q.answers for q in questions], k=qsft.top_k,
      max_answer_length=evaluation.max_answer_length, level=qsft.level,
      gold_titles=[[q.title] for q in questions])


def _epoch(data: DataSettings, train: TrainSettings, evaluation: EvalSettings,
           qsft: QsftSettings, run: Setup, epoch: int) -> tuple[list[float], int]:
  """Retrieves the candidates of every training question with the current question encoders
  (epoch 1: those of the setup), then one pass over the questions that have a positive.
  Returns (losses, questions used)."""
  questions = run.questions
  if epoch == 0:
    candidates, run.first = run.first, None
  else:
    candidates = _candidates(data, evaluation, qsft, run.index, run.trainer.model(),
                             run.tokenizer, questions, run.mesh)
    run.trainer = _retrainer(run, qsft, epoch, _steps(candidates, qsft))
  usable = np.flatnonzero(candidates.positive.any(1))
  if len(usable) < qsft.batch_size:
    log.warning("QSFT epoch %d: only %d of %d questions have a positive among their top %d: "
                "fewer than a batch, no update", epoch + 1, len(usable), len(questions),
                qsft.top_k)
  order = np.random.default_rng([train.seed, epoch]).permutation(usable)
  mine = local_rows(batch_sharding(run.mesh), qsft.batch_size)

  def batch(b: int) -> dict:
    rows = order[b * qsft.batch_size:(b + 1) * qsft.batch_size][mine]
    local = {"question_input_ids": run.ids[rows], "question_attention_mask": run.mask[rows],
             "candidate_start": run.vectors(candidates.start[rows]),
             "candidate_end": run.vectors(candidates.end[rows]),
             "candidate_valid": candidates.valid[rows],
             "candidate_positive": candidates.positive[rows]}
    return global_batch(local, batch_sharding(run.mesh), qsft.batch_size, len(rows))

  losses = []
  run_steps(run.trainer, range(len(order) // qsft.batch_size), batch,
            [Hook(lambda d: True, lambda d, m: losses.append(float(jax.device_get(m["loss"]))))])
  run.steps += len(losses)
  return losses, len(usable)


def fine_tune(settings: QsftRunSettings, workdir: Workdir) -> dict:
  """QSFT's epochs, dev EM@1 measured before and after each, the best checkpoint kept in
  `checkpoints_qsft`; returns (and writes) `_report`'s result."""
  qc, data, evaluation = settings.qsft, settings.data, settings.evaluation
  run = _setup(settings, workdir)
  eval_batch = round_to_devices(evaluation.batch_size, run.mesh)
  writer = MetricsWriter(workdir.report("qsft_metrics.jsonl"), -1)  # a QSFT run starts afresh
  if jax.process_index() == 0:
    remove(workdir.checkpoints("qsft"))
  checkpointer = Checkpointer(workdir.checkpoints("qsft"), keep=1, best_metric=QSFT_METRIC)
  dev_scores = lambda: _dev_scores(data, evaluation, run.index, run.trainer.model(),
                                   run.tokenizer, run.dev, run.mesh, eval_batch)
  before = dev_scores()
  summary = lambda record: {k: v for k, v in record.items() if k != "hits"}  # metrics' lines
  writer.write({"step": 0, "split": "dev", **summary(before)})
  log.info("QSFT on %s (%s%s), %d training questions; dev EM@1 before: %.2f", qc.index,
           qc.level, ", quantisation-aware" if qc.quantized else "", len(run.questions),
           before["em@1"])
  history, step = [], 0
  for epoch in range(qc.epochs):
    start_time = time.perf_counter()
    losses, usable = _epoch(data, settings.train, evaluation, qc, run, epoch)
    step += len(losses)
    scores = dev_scores()
    record = {"step": step, "epoch": epoch + 1, "split": "dev", **scores,
              "train_loss": float(np.mean(losses)) if losses else None,
              "questions_with_positive": int(usable),
              "last_learning_rate": float(run.trainer.schedule(max(run.steps - 1, 0))),
              "seconds": time.perf_counter() - start_time}
    writer.write(summary(record))
    history.append(record)
    if step not in checkpointer.manager.all_steps():  # an epoch without update saves nothing
      checkpointer.save(step, run.trainer.state,
                        {"step": step, "epoch": epoch + 1, "qsft": json.dumps(section_dict(qc)),
                         "trained_step": run.trained_step},
                      metrics={QSFT_METRIC: scores[QSFT_METRIC]})
    log.info("QSFT epoch %d: %d of %d questions have a positive; loss %.3f; dev EM@1 %.2f",
             epoch + 1, usable, len(run.questions), record["train_loss"] or float("nan"),
             scores["em@1"])
  best = checkpointer.best_step()
  checkpointer.close()
  writer.close()
  return _report(qc, workdir, run, before, history, best)


def _report(qsft: QsftSettings, workdir: Workdir, run: Setup, before: dict, history: list,
            best) -> dict:
  """The run's result (dev EM@1 before and after each epoch, the kept epoch against the start),
  written to `qsft_results_<index>[_quantized].json` and printed."""
  result = {"index": qsft.index, "level": qsft.level, "quantized": qsft.quantized,
            "top_k": qsft.top_k, "learning_rate": qsft.learning_rate, "batch_size": qsft.batch_size,
            "train_questions": len(run.questions), "dev_questions": len(run.dev),
            "schedule_steps": run.steps,
            "before": before, "epochs": history, "best_step": best,
            "best_em@1": max([before["em@1"]] + [h["em@1"] for h in history]),
            "improved": any(h["em@1"] > before["em@1"] for h in history)}
  kept = [h for h in history if h["step"] == best]
  if kept:  # the kept epoch against the start, question by question (exact McNemar)
    gained, lost, p = metrics.mcnemar_p(kept[-1]["hits"]["em@1"], before["hits"]["em@1"])
    result["best_epoch_vs_before"] = {"epoch": kept[-1]["epoch"], "gained": gained,
                                      "lost": lost, "p_value": p}
  if history and not result["improved"]:
    log.warning("QSFT did not raise dev EM@1 (%.2f before, %s after the epochs): its best "
                "checkpoint (step %s, `eval.checkpoint=qsft`) is worse than the question "
                "encoders it started from; keep eval.checkpoint=latest", before["em@1"],
                " / ".join(f"{h['em@1']:.2f}" for h in history), best)
  if jax.process_index() == 0:
    name = f"qsft_results_{qsft.index}{'_quantized' if qsft.quantized else ''}.json"
    write_json(workdir.report(name), result)
  paired = result.get("best_epoch_vs_before")
  print(f"QSFT ({qsft.index}): dev EM@1 {before['em@1']:.2f} -> "
        + " -> ".join(f"{h['em@1']:.2f}" for h in history)
        + (f" (epoch {paired['epoch']} against the start: {paired['gained']} questions gained, "
           f"{paired['lost']} lost, McNemar p = {paired['p_value']:.3g})" if paired else ""))
  return result
