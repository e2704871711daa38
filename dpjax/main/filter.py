"""`run.py filter`: the token filter head trained, validated by AUC-PR, and its thresholds swept
on the dump.
"""
from __future__ import annotations

import numpy as np
from flax import nnx

from dpjax.data import Tokenizer
from dpjax.data.questions import read_questions, sample_questions
from dpjax.errors import DataError
from dpjax.index.dump_reader import Dump, require_vectors
from dpjax.index.faiss_index import index_folder
from dpjax.io import write_json
from dpjax.workdir import Workdir
from dpjax.models.encoders import encode_questions
from dpjax.parallel import make_mesh, round_to_devices
from dpjax.token_filter import rewrite_dump_logits, threshold_sweep, train_head, window_splits
from dpjax.loading import checked_dump, data_paths, save_filter_head
from dpjax.main import restore, writes_to
from dpjax.settings import Settings


@writes_to
def run(settings: Settings, workdir: Workdir) -> dict:
  """`run.py filter`: train the head, validate by AUC-PR, sweep thresholds on the dump."""
  fc = settings.filter
  model, step = restore(settings, workdir)
  paths = data_paths(settings.data, settings.index, workdir)
  # (its logits are rewritten with the head trained here, after the training)
  # (the filter rewrites its logits from its vectors, and sweeps over them)
  require_vectors(checked_dump(settings.data, settings.index, workdir, model), paths["dump"],
                  "run.py filter")
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  mesh = make_mesh()
  batch = round_to_devices(settings.eval.batch_size, mesh)
  splits, rates = window_splits(settings.data, fc, workdir, model, tokenizer, mesh, batch)
  for name, rate in rates.items():
    if not rate > 0:  # (NaN: no context token at all) AUC-PR or the loss would be undefined
      raise DataError(f"filter: the {len(splits[name][0])} {name} windows sampled hold no "
                      f"answer start or end token (filter.{name}_windows); the head can be "
                      "neither trained nor validated on them")
  head = nnx.state(model.filter_head, nnx.Param)
  kernel, bias, history = train_head(
      splits["train"], splits["dev"], np.asarray(head["kernel"][...]),
      np.asarray(head["bias"][...]), epochs=fc.epochs, learning_rate=fc.learning_rate,
      batch_size=fc.batch_size, seed=fc.seed)
  best_auc = max(h["dev_auc_pr"] for h in history)
  rewrite_dump_logits(paths["dump"], kernel, bias, save_filter_head(workdir, kernel, bias))
  questions = sample_questions(read_questions(paths["questions"]), fc.sweep_questions, fc.seed)
  q_start, q_end = encode_questions(model, tokenizer, [q.question for q in questions],
                                    max_query_length=settings.data.max_query_length,
                                    batch_size=batch, mesh=mesh)
  sweep = threshold_sweep(Dump.load(paths["dump"]), q_start, q_end,
                          [q.answers for q in questions], fc.keep_fractions,
                          settings.eval.max_answer_length)
  full = next(s for s in sweep if s["threshold"] is None)["em@1"] if any(
      s["threshold"] is None for s in sweep) else max(s["em@1"] for s in sweep)
  good = [s for s in sweep if s["em@1"] >= full - fc.max_em_drop]
  chosen = min(good, key=lambda s: s["tokens"])
  result = {"model_step": step, "dev_auc_pr": best_auc, "history": history,
            "train_windows": int(len(splits["train"][0])),
            "dev_windows": int(len(splits["dev"][0])),
            # AUC-PR of a random scorer: the rate of positives (answer starts/ends) among tokens.
            "positive_rate": rates, "sweep_questions": len(questions),
            "sweep": sweep, "max_em_drop": fc.max_em_drop, "chosen": chosen}
  write_json(workdir.report("filter_results.json"), result)
  threshold = chosen["threshold"]
  use = ("no threshold keeps EM@1 within filter.max_em_drop: keep the unfiltered index"
         if threshold is None else
         f"build it with `run.py index --set index.filter_threshold={threshold}` and search it "
         f"with `--set index.search_index={index_folder('Flat', threshold)}`")
  print(f"token filter: dev AUC-PR {best_auc:.4f}; chosen threshold {threshold} keeps "
        f"{100 * chosen['kept_fraction']:.1f}% of the tokens (EM@1 {chosen['em@1']:.2f} vs "
        f"{full:.2f} unfiltered); {use}")
  return result
