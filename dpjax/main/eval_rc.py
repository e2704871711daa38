"""`run.py eval_rc`: reading-comprehension EM/F1 of the workdir's model on the dev split.
"""
from __future__ import annotations

import logging

from dpjax.data import Tokenizer, data_files, load_rc_split
from dpjax.io import write_json
from dpjax.workdir import Workdir
from dpjax.parallel import make_mesh, round_to_devices
from dpjax.reading import evaluate_rc
from dpjax.main import restore
from dpjax.settings import Settings

log = logging.getLogger(__name__)


def run(settings: Settings, workdir: str) -> dict:
  """`run.py eval_rc`: reading-comprehension EM/F1 on the dev split of the workdir's model (its
  latest checkpoint, or the best one with `eval.checkpoint=best`; the untrained configured model
  when the workdir has no checkpoint).

  Writes `workdir/rc_eval.json` (metrics) and `workdir/rc_predictions.json` ({id: answer}).
  """
  workdir = Workdir(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  data, evaluation = settings.data, settings.eval
  tokenizer = Tokenizer.from_pretrained(settings.model.tokenizer)
  dev = load_rc_split(data_files(data, workdir)["dev"], tokenizer, data,
                      limit=evaluation.limit or None)
  # The untrained model's RC accuracy is a baseline: a workdir without checkpoints is allowed.
  model, step = restore(settings, workdir, allow_untrained=True)
  mesh = make_mesh()
  batch_size = round_to_devices(evaluation.batch_size, mesh)
  scores, predictions = evaluate_rc(model, dev.features, dev.passages, dev.questions,
                                    mesh=mesh, batch_size=batch_size,
                                    max_answer_length=evaluation.max_answer_length)
  log.info("RC dev (%s): EM %.2f F1 %.2f over %d questions", dev.path, scores["exact_match"],
           scores["f1"], scores["count"])
  write_json(workdir.report("rc_eval.json"), {**scores, "step": step})
  write_json(workdir.report("rc_predictions.json"), predictions)
  return scores
