"""The embedded default: MiniLM on the synthetic Wikipedia-like data set.

  python run.py eval_rc --config experiments/demo.py --workdir workdirs/demo
  python run.py eval_rc --config experiments/demo.py:tiny --workdir /tmp/tiny
"""
import ml_collections

from dpjax import config as common


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.model = common.model_config("minilm-l6")
  config.data = ml_collections.ConfigDict({
      "source": "synthetic", "seed": 0, "train_entities": 240, "dev_entities": 60,
      "questions_per_entity": 8, "max_seq_length": 128, "doc_stride": 64,
      "max_query_length": 32, "include_title": True,
  })
  config.eval = ml_collections.ConfigDict({"batch_size": 32, "max_answer_length": 10,
                                           "limit": 0})
  if arg == "tiny":
    config = common.make_tiny(config)
    config.data.update(train_entities=6, dev_entities=4, questions_per_entity=3)
  elif arg:
    raise ValueError(f"unknown config arg {arg!r} (expected: tiny)")
  return config
