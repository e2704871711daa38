"""The embedded default: MiniLM on the synthetic Wikipedia-like data set.

  python run.py train --config experiments/demo.py --workdir workdirs/demo
  python run.py train --config experiments/demo.py:tiny --workdir /tmp/tiny
"""
import ml_collections

from dpjax import config as common


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.model = common.model_config("minilm-l6")
  config.data = ml_collections.ConfigDict({
      "source": "synthetic", "seed": 0, "train_entities": 240, "dev_entities": 60,
      "questions_per_entity": 8, "max_seq_length": 96, "doc_stride": 48,
      "max_query_length": 24, "include_title": True,
  })
  config.train = common.train_config(batch_size=16, num_steps=120, learning_rate=1e-4,
                                     log_every=10, checkpoint_every=60)
  config.index = common.index_config()
  config.validation = common.validation_config()
  config.mine = common.mine_config()
  config.qsft = common.qsft_config()
  config.filter = common.filter_config()
  config.eval = common.eval_config(batch_size=32)
  config.serve = common.serve_config()
  if arg == "tiny":
    config = common.make_tiny(config)
    config.data.update(train_entities=6, dev_entities=4, questions_per_entity=3)
  elif arg:
    raise ValueError(f"unknown config arg {arg!r} (expected: tiny)")
  return config
