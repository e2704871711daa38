"""Query-side fine-tuning (DensePhrases Section 4.3; Kim et al. 2022): adapt the question encoders
to a fixed phrase index.

The phrase encoder and the index stay frozen (freezing by the config's parameter filter, the same
optimizer and jitted step as training, loss recipe `qsft`). At the start of every epoch the
current question encoders retrieve the top-k phrases of every training question from the index;
their start/end vectors are taken from the dump (exact) or reconstructed by the index's quantizer
(`qsft.quantized`: quantisation-aware training for IVF-SQ / (O)PQ indexes). The loss is the
marginal likelihood of the candidates whose text matches a gold answer (`level=phrase`) or whose
document (title) is a gold document (`level=document`, L_doc), plus the same on start-only and
end-only scores. Questions without any positive candidate are left out of the epoch. Dev EM@1 over
the full index is measured before training and after every epoch; the best checkpoint is kept in
`workdir/checkpoints_qsft` (`run.py eval --set eval.checkpoint=qsft` uses it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import shutil
import time
from typing import Sequence

import faiss
import numpy as np

from dpjax import metrics
from dpjax.config import write_json

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
  """Token vectors of candidates: stored in the dump, or as the index's quantizer reconstructs."""

  def __init__(self, index, quantized: bool):
    self.index, self.quantized = index, quantized
    if quantized:
      ivf = faiss.try_extract_index_ivf(index.index)
      if ivf is None:
        raise ValueError(f"quantisation-aware QSFT needs an IVF index, not "
                         f"{index.manifest['resolved_spec']}")
      ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # reconstruct by label (token id)

  def __call__(self, ids: np.ndarray) -> np.ndarray:
    """[..., D] float32 vectors of token ids (zeros for -1)."""
    flat = ids.reshape(-1)
    safe = np.maximum(flat, 0)
    if self.quantized:
      unique, inverse = np.unique(safe, return_inverse=True)
      vectors = self.index.index.reconstruct_batch(unique)[inverse]
    else:
      vectors = self.index.dump.vectors[safe].astype(np.float32)
    vectors[flat < 0] = 0.0
    return vectors.reshape(*ids.shape, -1)


def _dev_scores(index, model, tokenizer, questions, config, mesh, batch_size) -> dict:
  from dpjax.search import encode_questions
  q_start, q_end = encode_questions(model, tokenizer, [q["question"] for q in questions],
                                    max_query_length=config.data.max_query_length,
                                    batch_size=batch_size, mesh=mesh)
  found = index.search_phrases(q_start, q_end, 10,
                               max_answer_length=config.eval.max_answer_length)
  return metrics.open_domain_scores([[p.text for p in phrases] for phrases in found],
                                    [q["answers"] for q in questions])


@contextlib.contextmanager
def workdir_lock(path: pathlib.Path):
  """Holds `path` (e.g. `<workdir>/qsft.lock`) for one run: a second QSFT run in the same workdir
  would delete the first one's `checkpoints_qsft` and interleave its metrics. A lock whose process
  is gone (a killed run) is taken over."""
  from dpjax.data import DataError
  create = lambda: os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
  try:
    fd = create()
  except FileExistsError:
    try:
      pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
      pid = 0
    if pid and pid != os.getpid() and _process_alive(pid):
      raise DataError(f"{path}: another QSFT run (pid {pid}) is using this workdir; wait for it, "
                      "or run in a second workdir") from None
    log.warning("%s: taking over the lock of a run that is gone (pid %s)", path, pid or "?")
    path.unlink(missing_ok=True)
    try:
      fd = create()
    except FileExistsError:
      raise DataError(f"{path}: could not take the lock (another run took it)") from None
  with os.fdopen(fd, "w") as f:
    f.write(str(os.getpid()))
  try:
    yield
  finally:
    path.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # PermissionError (someone else's live process) counts as alive
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def run_qsft(config, workdir: str) -> dict:
  """`run.py qsft`: fine-tunes the question encoders of the workdir's model on its index (one run
  per workdir at a time: `<workdir>/qsft.lock`)."""
  import jax
  workdir = pathlib.Path(workdir)
  if jax.process_index() != 0:
    return _run_qsft(config, workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  with workdir_lock(workdir / "qsft.lock"):
    return _run_qsft(config, workdir)


def _run_qsft(config, workdir: pathlib.Path) -> dict:
  import jax
  from flax import nnx

  from dpjax.checkpoint import Checkpointer
  from dpjax.data import Tokenizer, data_files
  from dpjax.open_domain import data_paths, read_questions, restore_model, sample_questions
  from dpjax.parallel import batch_sharding, global_batch, local_rows, make_mesh, round_to_devices
  from dpjax.search import PhraseIndex, encode_questions
  from dpjax.train import MetricsWriter, init_state, make_optimizer, make_train_step

  workdir = pathlib.Path(workdir)
  qc = config.qsft
  paths = data_paths(config, workdir)
  model, trained_step = restore_model(config, workdir)
  index = PhraseIndex(paths["dump"], qc.index, nprobe=config.index.nprobe)
  vectors = CandidateVectors(index, qc.quantized)
  tokenizer = Tokenizer.from_pretrained(config.model.tokenizer)
  train_file = qc.questions or str(data_files(config.data, workdir)["train"])
  questions = sample_questions(read_questions(train_file), qc.limit, qc.seed)
  dev = sample_questions(read_questions(paths["questions"]), qc.dev_limit, qc.seed)
  if qc.level == "document" and any("title" not in q for q in questions):
    raise ValueError(f"{train_file}: document-level QSFT needs gold titles (SQuAD format)")
  mesh = make_mesh()
  if qc.batch_size % mesh.size:
    raise ValueError(f"qsft.batch_size {qc.batch_size} is not a multiple of {mesh.size} devices")
  eval_batch = round_to_devices(config.eval.batch_size, mesh)
  ids, mask = tokenizer.encode([q["question"] for q in questions], config.data.max_query_length)

  # The training machinery with the QSFT recipe and its freezing filter.
  tc = config.train.copy_and_resolve_references()
  tc.update(batch_size=qc.batch_size, learning_rate=qc.learning_rate, freeze=list(qc.freeze),
            dropout=qc.dropout)
  tc.loss.recipe = "qsft"
  steps_per_epoch = max(1, len(questions) // qc.batch_size)
  total = qc.epochs * steps_per_epoch
  _, params, _ = nnx.split(model, nnx.Param, ...)
  tx, schedule, labels = make_optimizer(tc, params, total)
  graphdef, state, sharding = init_state(model, tx, prebatch_size=0, batch_size=qc.batch_size,
                                         length=1, seed=tc.seed, mesh=mesh)
  step_fn = make_train_step(graphdef, tx, schedule, tc.loss, sharding, mesh, tc.dropout, labels)
  mine = local_rows(batch_sharding(mesh), qc.batch_size)
  writer = MetricsWriter(workdir / "qsft_metrics.jsonl", -1)  # a QSFT run starts afresh
  if jax.process_index() == 0:
    shutil.rmtree(workdir / "checkpoints_qsft", ignore_errors=True)
  checkpointer = Checkpointer(workdir / "checkpoints_qsft", keep=1, best_metric="em@1")
  current = lambda: nnx.merge(graphdef, state.params, state.rest)

  before = _dev_scores(index, current(), tokenizer, dev, config, mesh, eval_batch)
  writer.write({"step": 0, "split": "dev", **before})
  log.info("QSFT on %s (%s%s), %d training questions; dev EM@1 before: %.2f", qc.index,
           qc.level, ", quantisation-aware" if qc.quantized else "", len(questions),
           before["em@1"])
  history, step = [], 0
  for epoch in range(qc.epochs):
    start_time = time.perf_counter()
    q_start, q_end = encode_questions(current(), tokenizer, [q["question"] for q in questions],
                                      max_query_length=config.data.max_query_length,
                                      batch_size=eval_batch, mesh=mesh)
    candidates = retrieve_candidates(
        index, q_start, q_end, [q["answers"] for q in questions], k=qc.top_k,
        max_answer_length=config.eval.max_answer_length, level=qc.level,
        gold_titles=[[q.get("title", "")] for q in questions])
    usable = np.flatnonzero(candidates.positive.any(1))
    if len(usable) < qc.batch_size:
      log.warning("QSFT epoch %d: only %d of %d questions have a positive among their top %d: "
                  "fewer than a batch, no update", epoch + 1, len(usable), len(questions),
                  qc.top_k)
    order = np.random.default_rng([tc.seed, epoch]).permutation(usable)
    losses = []
    for b in range(len(order) // qc.batch_size):
      rows = order[b * qc.batch_size:(b + 1) * qc.batch_size][mine]
      batch = {"question_input_ids": ids[rows], "question_attention_mask": mask[rows],
               "candidate_start": vectors(candidates.start[rows]),
               "candidate_end": vectors(candidates.end[rows]),
               "candidate_valid": candidates.valid[rows],
               "candidate_positive": candidates.positive[rows]}
      state, step_metrics = step_fn(state, global_batch(batch, batch_sharding(mesh),
                                                        qc.batch_size, len(rows)))
      losses.append(float(jax.device_get(step_metrics["loss"])))
      step += 1
    scores = _dev_scores(index, current(), tokenizer, dev, config, mesh, eval_batch)
    record = {"step": step, "epoch": epoch + 1, "split": "dev", **scores,
              "train_loss": float(np.mean(losses)) if losses else None,
              "questions_with_positive": int(len(usable)),
              "seconds": time.perf_counter() - start_time}
    writer.write(record)
    history.append(record)
    if step not in checkpointer.manager.all_steps():  # an epoch without update saves nothing
      checkpointer.save(step, state, {"step": step, "epoch": epoch + 1, "qsft": qc.to_json(),
                                      "trained_step": trained_step},
                        metrics={"em@1": scores["em@1"]})
    log.info("QSFT epoch %d: %d of %d questions have a positive; loss %.3f; dev EM@1 %.2f",
             epoch + 1, len(usable), len(questions), record["train_loss"] or float("nan"),
             scores["em@1"])
  best = checkpointer.best_step()
  checkpointer.close()
  result = {"index": qc.index, "level": qc.level, "quantized": qc.quantized, "top_k": qc.top_k,
            "learning_rate": qc.learning_rate, "batch_size": qc.batch_size,
            "train_questions": len(questions), "dev_questions": len(dev), "before": before,
            "epochs": history, "best_step": best,
            "best_em@1": max([before["em@1"]] + [h["em@1"] for h in history])}
  if jax.process_index() == 0:
    name = f"qsft_results_{qc.index}{'_quantized' if qc.quantized else ''}.json"
    write_json(workdir / name, result)
  print(f"QSFT ({qc.index}): dev EM@1 {before['em@1']:.2f} -> "
        + " -> ".join(f"{h['em@1']:.2f}" for h in history))
  return result
