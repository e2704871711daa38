"""dpjax command line: `python run.py MODE --config experiments/x.py[:arg] --workdir DIR`.

Modes:
  train    train the phrase and question encoders, evaluating RC EM/F1 on dev; resumes
  eval_rc  reading-comprehension EM/F1 of the configured model on the dev split
  dump     encode every passage of the corpus with the trained phrase encoder
  index    build the configured faiss indexes over the dump
  search   answer --query questions open-domain
  eval     open-domain evaluation: EM@k, F1@k, passage Top-k / MRR@20 / P@20
  data     write the configured data set (the synthetic one is generated) and print its counts
"""
import argparse
import logging
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument("mode", choices=["train", "eval_rc", "data", "dump", "index", "search", "eval"])
  parser.add_argument("--config", required=True, help="experiments/<name>.py[:arg]")
  parser.add_argument("--workdir", required=True, help="where outputs and checkpoints go")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field, e.g. --set eval.batch_size=16")
  parser.add_argument("--query", action="append", default=[], help="a question (search mode)")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src.xla_bridge"):  # Orbax's per-save chatter, backend probing
    logging.getLogger(noisy).setLevel(logging.WARNING)

  from dpjax.config import load_config
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
    elif args.mode == "data":
      from dpjax.data import run_data
      run_data(config, args.workdir)
    else:
      from dpjax import open_domain
      if args.mode == "search":
        open_domain.run_search(config, args.workdir, args.query)
      else:
        {"dump": open_domain.run_dump, "index": open_domain.run_index,
         "eval": open_domain.run_eval_open}[args.mode](config, args.workdir)
  except (DataError, DumpError) as e:
    logging.error("%s", e)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
