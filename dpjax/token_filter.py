"""The token filter trained on its own (Kim et al. 2022, Section 6): `run.py filter`.

After the encoders are trained, the filter head (a linear layer on the phrase vector h_t giving a
start and an end logit) is trained on frozen phrase vectors of training windows with the token
filter BCE (targets: the gold answer starts and ends of the window's questions), and validated
on dev windows by AUC-PR (average precision over all thresholds) of "keep this token" scores
(max of the two logits) against "is a gold start or end"; the epoch with the best AUC-PR is kept.

Then a threshold sweep over the workdir's dump: filter logits recomputed from the stored vectors
with the trained head, and for thresholds keeping 100%, 75%, 50%, ... of the tokens, an exact
index over the kept tokens answers the dev questions (EM@1, EM@10). The chosen threshold is the
one keeping the fewest tokens that loses at most `filter.max_em_drop` EM@1 points. The trained
head's logits are written into the dump (`filter_logits.npy` of every shard) so that
`run.py index --set index.filter_threshold=T` uses them, and the head goes into
`workdir/filter_head.npz`, `dump_phrases` applies it to later dumps of this workdir.
"""
from __future__ import annotations

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpjax import losses, metrics
from dpjax.data import data_files, load_rc_split
from dpjax.index.dump_reader import Dump
from dpjax.index.manifest import read_manifest, write_manifest
from dpjax.index.shards import record_rewrite
from dpjax.index.evaluate import retrieval_scores
from dpjax.index.phrase_index import PhraseIndex
from dpjax.io import save_npy_atomic
from dpjax.models.encoders import bound, phrase_batches
from dpjax.loading import filter_head_digest
from dpjax.settings import DataSettings, FilterSettings

log = logging.getLogger(__name__)


def window_targets(features) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(windows, start targets [W, L], end targets [W, L]) of the windows holding an answer."""
  answerable = np.flatnonzero(features.start_position > 0)
  windows, inverse = np.unique(features.window_index[answerable], return_inverse=True)
  length = features.windows.input_ids.shape[1]
  start = np.zeros((len(windows), length), bool)
  end = np.zeros((len(windows), length), bool)
  start[inverse, features.start_position[answerable]] = True
  end[inverse, features.end_position[answerable]] = True
  return windows, start, end


def encode_windows(model, windows, rows: np.ndarray, mesh, batch_size: int) -> np.ndarray:
  """Frozen phrase vectors [N, L, D] (float16) of windows `rows`."""
  out = np.zeros((len(rows), windows.input_ids.shape[1], model.config.hidden_size), np.float16)
  for part, h in phrase_batches(bound(model, "phrases"), windows.input_ids[rows],
                                windows.attention_mask[rows], batch_size=batch_size, mesh=mesh):
    out[part, :h.shape[1]] = h  # columns past the batch's width stay 0 (padding)
  return out


def filter_scores(vectors: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
  """[..., 2] start/end filter logits of token vectors (numpy or jax arrays)."""
  return vectors.astype(np.float32) @ kernel + bias


def auc_pr(vectors, mask, start, end, kernel, bias) -> float:
  """AUC-PR of the keep score max(start, end logit) for "gold start or end" over masked tokens."""
  logits = filter_scores(vectors[mask], kernel, bias)
  return metrics.average_precision(logits.max(-1), (start | end)[mask])


def train_head(train, dev, kernel, bias, *, epochs: int, learning_rate: float, batch_size: int,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[dict]]:
  """Trains the filter head on frozen vectors; returns the best (kernel, bias) by dev AUC-PR.

  Args:
    train, dev: (vectors [N, L, D], mask [N, L], start [N, L], end [N, L]).
  """
  params = {"kernel": jnp.asarray(kernel, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)}
  tx = optax.adam(learning_rate)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, h, mask, start, end):
    def loss_fn(p):
      logits = filter_scores(h, p["kernel"], p["bias"])
      return losses.filter_loss(logits, start, end, mask).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  best = (auc_pr(*dev, kernel, bias), np.asarray(kernel), np.asarray(bias))
  history = [{"epoch": 0, "dev_auc_pr": best[0]}]
  rng = np.random.default_rng(seed)
  # Full batches only (a short last one is left out), but a training set under one batch is
  # one batch: it took no step at all, and returned the untrained head.
  batch_size = max(1, min(batch_size, len(train[0])))
  for epoch in range(1, epochs + 1):
    order = rng.permutation(len(train[0]))
    epoch_losses = []
    for lo in range(0, len(order) - batch_size + 1, batch_size):
      rows = np.sort(order[lo:lo + batch_size])
      params, opt_state, loss = step(params, opt_state, *(x[rows] for x in train))
      epoch_losses.append(float(loss))
    k, b = np.asarray(params["kernel"]), np.asarray(params["bias"])
    score = auc_pr(*dev, k, b)
    history.append({"epoch": epoch, "train_loss": float(np.mean(epoch_losses)),
                    "dev_auc_pr": score})
    log.info("filter epoch %d: loss %.4f, dev AUC-PR %.4f", epoch, history[-1]["train_loss"],
             score)
    if score > best[0]:
      best = (score, k, b)
  return best[1], best[2], history


def rewrite_dump_logits(dump_dir: pathlib.Path, kernel, bias, head: dict | None = None) -> None:
  """Recomputes every shard's filter_logits.npy from its stored vectors (atomic per file);
  `head`: the head's `filter_head_digest` (None: computed here)."""
  manifest = read_manifest(dump_dir, rewriting_filter=True)
  manifest.pop("filter_rewrite_incomplete", None)
  # Marked first: a rewrite killed half-way leaves shards of two heads, which read_manifest
  # then refuses until `run.py filter` is run again.
  write_manifest(dump_dir, {**manifest, "filter_rewrite_incomplete": True})
  for shard in manifest["shards"]:
    path = dump_dir / shard["name"]
    vectors = np.load(path / "vectors.npy", mmap_mode="r")
    logits = np.concatenate([filter_scores(vectors[lo:lo + 65536], kernel, bias)
                             for lo in range(0, len(vectors), 65536)]).astype(np.float16)
    save_npy_atomic(path / "filter_logits.npy", logits)
    record_rewrite(path, shard, "filter_logits.npy")
  manifest["filter_head"] = head or filter_head_digest(kernel, bias)
  write_manifest(dump_dir, manifest)


def window_splits(data: DataSettings, filtering: FilterSettings, workdir, model, tokenizer, mesh,
                  batch: int):
  """Frozen vectors and targets of a seeded sample of train and dev windows holding answers:
  ({split: (vectors, mask, start, end)}, {split: rate of answer starts/ends among tokens})."""
  fc = filtering
  files = data_files(data, workdir)
  splits, rates = {}, {}
  for name, path, limit in (("train", files["train"], fc.train_windows),
                            ("dev", files["dev"], fc.dev_windows)):
    split = load_rc_split(path, tokenizer, data)
    windows, start, end = window_targets(split.features)
    keep = np.random.default_rng([fc.seed, len(name)]).permutation(len(windows))[:limit]
    keep.sort()
    w = split.features.windows
    rows = windows[keep]
    vectors = encode_windows(model, w, rows, mesh, batch)
    splits[name] = (vectors, w.context_mask[rows] & w.is_max_context[rows], start[keep],
                    end[keep])
    rates[name] = float((start[keep] | end[keep])[splits[name][1]].mean())
    log.info("filter %s: %d windows, %.2f%% of context tokens are answer starts/ends", name,
             len(rows), 100 * rates[name])
  return splits, rates


def threshold_sweep(dump: Dump, q_start, q_end, answers, keep_fractions,
                    max_answer_length: int) -> list[dict]:
  """EM@1/EM@10 of an exact index over the tokens a threshold keeps, for thresholds keeping each
  fraction of the dump's tokens (by the dump's filter logits; fraction 1: no threshold)."""
  keep_score = dump.filter_logits.astype(np.float32).max(1)
  sweep = []
  for fraction in keep_fractions:
    threshold = (None if fraction >= 1 else
                 float(np.quantile(keep_score, 1 - fraction, method="higher")))
    kept = (np.arange(len(keep_score)) if threshold is None
            else np.flatnonzero(keep_score >= threshold))
    index = PhraseIndex.over_tokens(dump, kept)
    report = retrieval_scores(index, q_start, q_end, answers,
                              max_answer_length=max_answer_length, passage_k=0)
    sweep.append({"threshold": threshold, "tokens": int(len(kept)),
                  "kept_fraction": len(kept) / len(keep_score), **report})
    log.info("filter threshold %s keeps %d tokens (%.1f%%): EM@1 %.2f EM@10 %.2f", threshold,
             len(kept), 100 * sweep[-1]["kept_fraction"], report["em@1"], report["em@10"])
  return sweep
