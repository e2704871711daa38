"""SQuAD v1.1 reading comprehension with MiniLM.

`data.dir` must point at a folder holding train-v1.1.json and dev-v1.1.json; the default is the
example path `../shared/data/squad` (relative to the repository root) used on our machines.

  python run.py data --config experiments/squad.py --workdir workdirs/squad
  python run.py eval_rc --config experiments/squad.py --workdir workdirs/squad \
      --set data.dir=/path/to/squad
"""
import ml_collections

from dpjax import config as common


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.model = common.model_config("minilm-l6")
  config.data = ml_collections.ConfigDict({
      "source": "squad", "dir": "../shared/data/squad", "train_file": "train-v1.1.json",
      "dev_file": "dev-v1.1.json", "max_seq_length": 384, "doc_stride": 128,
      "max_query_length": 64, "include_title": True,
  })
  config.eval = ml_collections.ConfigDict({"batch_size": 32, "max_answer_length": 10,
                                           "limit": 0})
  if arg == "cpu":
    config.data.max_seq_length = 192
    config.data.doc_stride = 64
  elif arg == "tiny":
    config = common.make_tiny(config)
    config.data.max_seq_length = 64
    config.data.doc_stride = 32
    config.eval.limit = 16
  elif arg:
    raise ValueError(f"unknown config arg {arg!r} (expected: cpu or tiny)")
  return config
