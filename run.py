"""dpjax command line: `python run.py MODE --config experiments/x.py[:arg] --workdir DIR`.

Modes:
  train    train the phrase and question encoders, evaluating RC EM/F1 on dev; resumes
  eval_rc  reading-comprehension EM/F1 of the configured model on the dev split
  dump     encode every passage of the corpus with the trained phrase encoder
  index    build the configured faiss indexes over the dump
  search   answer --query questions open-domain
  eval     open-domain evaluation: EM@k, F1@k, passage Top-k / MRR@20 / P@20
  data     write the configured data set (the synthetic one is generated) and print its counts
  subcorpus  write the validation subcorpora C0, R_r, H_k (validation.kinds) of the corpus
  mine     mine hard negatives for the training questions from the model's full index
  qsft     query-side fine-tuning of the question encoders on the workdir's index
  filter   train the token filter on frozen phrase vectors; threshold sweep
"""
import argparse
import logging
import os
import sys
import traceback


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument("mode", choices=["train", "eval_rc", "data", "dump", "index", "search", "eval",
                                           "subcorpus", "mine", "qsft", "filter"])
  parser.add_argument("--config", required=True, help="experiments/<name>.py[:arg]")
  parser.add_argument("--workdir", required=True, help="where outputs and checkpoints go")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field, e.g. --set eval.batch_size=16")
  parser.add_argument("--query", action="append", default=[], help="a question (search mode)")
  hosts = parser.add_argument_group("many processes/hosts (jax.distributed; see README)")
  hosts.add_argument("--coordinator", help="host:port of process 0")
  hosts.add_argument("--num_processes", type=int)
  hosts.add_argument("--process_id", type=int)
  hosts.add_argument("--distributed", action="store_true",
                     help="join using the cluster environment (SLURM, Open MPI, TPU pods)")
  args = parser.parse_args(argv)
  from dpjax.config import setup_logging
  setup_logging()
  from dpjax.distributed import initialize
  try:
    initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
  except ValueError as e:
    parser.error(str(e))

  from dpjax.config import ConfigError, load_config
  from dpjax.data import DataError
  from dpjax.index.dump import DumpError
  config = load_config(args.config, args.set)
  try:
    if args.mode == "train":
      from dpjax.train import train_and_evaluate
      train_and_evaluate(config, args.workdir)
    elif args.mode == "eval_rc":
      from dpjax.rc import run_eval_rc
      run_eval_rc(config, args.workdir)
    elif args.mode == "qsft":
      from dpjax.qsft import run_qsft
      run_qsft(config, args.workdir)
    elif args.mode == "filter":
      from dpjax.token_filter import run_filter
      run_filter(config, args.workdir)
    elif args.mode == "data":
      from dpjax.data import run_data
      run_data(config, args.workdir)
    else:
      from dpjax import open_domain
      if args.mode == "search":
        open_domain.run_search(config, args.workdir, args.query)
      else:
        {"dump": open_domain.run_dump, "index": open_domain.run_index,
         "eval": open_domain.run_eval_open, "subcorpus": open_domain.run_subcorpus,
         "mine": open_domain.run_mine}[args.mode](config, args.workdir)
  except (ConfigError, DataError, DumpError) as e:
    logging.error("%s", e)
    return _exit(2)
  except BaseException:
    if _many_processes():  # the others would wait for this one at the next barrier: end the job
      traceback.print_exc()
      return _exit(1)
    raise
  return 0


def _many_processes() -> bool:
  import jax
  return jax.process_count() > 1


def _exit(code: int) -> int:
  """In a multi-process job, exits at once (no shutdown barrier the other processes would never
  reach): the coordination service then ends the whole job instead of letting it hang."""
  if _many_processes():
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


if __name__ == "__main__":
  sys.exit(main())
