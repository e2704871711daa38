"""The embedded default: MiniLM on the synthetic Wikipedia-like data set.

  make demo   # run.py train, dump, index, eval --config experiments/demo.py --workdir workdirs/demo
  python run.py train --config experiments/demo.py:tiny --workdir /tmp/tiny   # the tests' config

Expected: the RC and open-domain figures of results/demo.md (dense search, the default here: hybrid
is measured there too), in minutes on a CPU.
"""
from dpjax import config as common


def get_config(arg=None):
  config = common.base_config(
      {"source": "synthetic", "seed": 0, "train_entities": 240, "dev_entities": 60,
       "questions_per_entity": 8, "max_seq_length": 96, "doc_stride": 48,
       "max_query_length": 24, "include_title": True},
      train={"batch_size": 16, "num_steps": 120, "learning_rate": 1e-4, "log_every": 10,
             "checkpoint_every": 60},
      eval_batch_size=32)
  if arg == "tiny":
    config = common.make_tiny(config)
    config.data.update(train_entities=6, dev_entities=4, questions_per_entity=3)
  elif arg:
    raise ValueError(f"unknown config arg {arg!r} (expected: tiny)")
  return config
