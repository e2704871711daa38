"""dpjax command line: `dpjax MODE --workdir DIR [--config x.py[:arg]]`, or `python run.py ...`."""
import argparse
import logging
import pkgutil
import sys
import traceback

from dpjax.config import run_in_workdir, setup_logging
from dpjax.errors import EXPECTED, Preempted

# mode: what it does; its program is run(config, workdir, ...) in dpjax/main/<mode>.py
MODES = {
    "train": "train the encoders, RC EM/F1 on dev; resumes",
    "eval_rc": "reading-comprehension EM/F1 of the model on dev",
    "teacher": "train the cross-encoder teacher; write its logits",
    "data": "write the configured data set and print its counts",
    "dump": "encode every passage of the corpus",
    "index": "build the configured faiss indexes over the dump",
    "search": "answer --query questions open-domain",
    "eval": "open-domain EM@k, F1@k, passage Top-k/MRR/P@k",
    "subcorpus": "write validation subcorpora C0, R_r, H_k",
    "mine": "mine hard negatives for the training questions",
    "qsft": "query-side fine-tuning of the question encoders",
    "filter": "train the token filter; threshold sweep",
    "export": "the encoders as Hugging Face BERT folders (--out)",
    "serve": "HTTP search service and web page (serve.host/port)",
    "verify": "check every file against its digest from writing",
}


def parse(argv=None) -> argparse.Namespace:
  modes = "\n".join(f"  {name:<10} {text}" for name, text in MODES.items())
  parser = argparse.ArgumentParser(description=f"{__doc__}\nModes:\n{modes}",
                                   formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument("mode", choices=list(MODES))
  parser.add_argument("--config", help="experiments/<name>.py[:arg]; default: the workdir's")
  parser.add_argument("--workdir", required=True, help="where outputs and checkpoints go")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field, e.g. --set eval.batch_size=16")
  parser.add_argument("--query", action="append", default=[], help="a question (search mode)")
  parser.add_argument("--out", help="the folder export writes")
  parser.add_argument("--allow_unverified", action="store_true", help="verify: pass undigested")
  hosts = parser.add_argument_group("many processes/hosts (jax.distributed; see README)")
  hosts.add_argument("--coordinator", help="host:port of process 0")
  for name in ("--num_processes", "--process_id"):
    hosts.add_argument(name, type=int)
  hosts.add_argument("--distributed", action="store_true", help="join via SLURM/Open MPI/TPU pods")
  hosts.add_argument("--init_timeout", type=int, default=300,
                     help="seconds to wait for the coordinator and the other processes")
  parser.add_argument("--debug", action="store_true", help="tracebacks of expected errors too")
  parser.add_argument("--verbose", action="store_true", help="faiss's, Orbax's INFO logs too")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  from dpjax import distributed  # starts JAX: not for `--help`
  setup_logging(debug=args.debug, verbose=args.verbose)
  try:
    distributed.enable_compilation_cache()
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           auto=args.distributed, timeout=args.init_timeout)
    mode = pkgutil.resolve_name(f"dpjax.main.{args.mode}:run")
    extra = {"search": {"queries": args.query}, "export": {"out": args.out},
             "verify": {"allow_unverified": args.allow_unverified}}.get(args.mode, {})
    run_in_workdir(mode, args.config, args.set, args.workdir, **extra)
  except (*EXPECTED, OSError, Preempted) as e:  # bad input or state, I/O: one line (stack:
    logging.error("%s", e, exc_info=args.debug)  # --debug); SIGTERM: stopped with a checkpoint
    return distributed.exit_for(e)
  except BaseException:
    if distributed.many_processes():  # the others would wait for it at the next barrier
      traceback.print_exc()
      return distributed.exit_now(1)
    raise
  return 0


if __name__ == "__main__":
  sys.exit(main())
