"""Experiment configs: `experiments/<name>.py[:arg]` files with `get_config(arg)`."""
from __future__ import annotations

import ast
import importlib.util
import logging
import pathlib
import re
from typing import Sequence

import ml_collections

from dpjax.errors import ConfigError, DataError
from dpjax.io import read_json, write_json
from dpjax.settings import Settings
from dpjax.workdir import Workdir


def load_config(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path/to/config.py[:arg]`, applies `key.sub=value` overrides and checks the values.

  Override values are parsed as Python literals when possible (`3`, `1e-4`, `True`, `'x'`),
  otherwise taken as strings. Every problem is a `ConfigError` naming the file or field.
  """
  path, _, arg = spec.partition(":")
  file = pathlib.Path(path)
  if not file.is_file():
    raise ConfigError(f"config file not found: {file}")
  module_spec = importlib.util.spec_from_file_location(f"dpjax_config_{file.stem}", file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{file} defines no get_config(arg)")
  try:
    config = module.get_config(arg or None)
  except ValueError as e:  # e.g. an unknown config arg
    raise ConfigError(f"{spec}: {e}") from None
  with_defaults(config)
  model = config.get("model")
  follows = model is not None and "tokenizer" in model and model.tokenizer == model.name
  for override in overrides:
    _override(config, override)
  if follows and not any(o.partition("=")[0].strip() == "model.tokenizer" for o in overrides):
    model.tokenizer = model.name  # --set model.name=X: X's tokenizer, unless one is set too
  check_config(config)
  return config


def load_settings(spec: str, overrides: Sequence[str] = ()) -> Settings:
  """`load_config`'s config as its typed sections (`Settings`), what the programs and the
  library functions read."""
  return Settings.of(load_config(spec, overrides))


SAVED_CONFIG = "dpjax_config.json"  # in a workdir: the resolved config of the run that made it
# The fields a workdir's artifacts (checkpoints, data, dumps) are built with: a --config that gives
# them other values is refused there. The rest (train.*, index.*, eval.*, serve.*, data.dir: where
# the data is read from) may change from run to run.
BUILT_WITH = ("model.name", "model.tokenizer", "model.init", "model.random",
              "model.share_query_encoders", "data")
NOT_BUILT_WITH = ("data.dir",)


def check_workdir(workdir: str) -> None:
  """Refuses a --workdir that is, or lies under, a file (the modes' mkdir would say only
  "[Errno 17] File exists" or "[Errno 20] Not a directory")."""
  path = pathlib.Path(workdir)
  for candidate in (path, *path.parents):
    if candidate.exists():
      if not candidate.is_dir():
        where = "is" if candidate == path else f"lies under {candidate}, which is"
        raise DataError(f"--workdir {workdir} {where} a file, not a directory: pick another "
                        "--workdir")
      return


def run_in_workdir(mode, spec: str | None, overrides: Sequence[str], workdir: str, **kwargs):
  """Runs `mode(settings, workdir, **kwargs)` with `workdir_config`'s config as typed sections
  (`Settings`, built here once for every mode), the workdir given as a `Workdir` (its layout). The run that makes
  the workdir (absent or empty before, holding something after) saves that config there
  (SAVED_CONFIG) when it ends, also when it stops early: what it made, it made with this config.
  The API key is not saved."""
  check_workdir(workdir)
  config = workdir_config(spec, overrides, workdir)
  path = Workdir(workdir)
  new = not path.is_dir() or not any(path.iterdir())
  try:
    return mode(Settings.of(config), path, **kwargs)
  finally:
    if new and path.is_dir() and any(path.iterdir()) and not (path / SAVED_CONFIG).exists():
      saved = ml_collections.ConfigDict(config.to_dict())
      if "serve" in saved:  # the key stays out of files (serve.api_key_env names a variable)
        saved.serve.api_key = ""
      given = [o for o in overrides if o.partition("=")[0].strip() != "serve.api_key"]
      write_json(path / SAVED_CONFIG, {"config": spec, "set": given, "resolved": saved.to_dict()})


def workdir_config(spec: str | None, overrides: Sequence[str],
                   workdir: str) -> ml_collections.ConfigDict:
  """The config of a run in `workdir`: the file `spec` (`path.py[:arg]`) or, without one, the
  config the workdir saved (SAVED_CONFIG), with the overrides. A ConfigError if neither exists,
  or if `spec`, with the overrides the workdir was made with, gives a field its artifacts were
  built with (BUILT_WITH) another value: another experiment's config. (This run's own overrides
  are left to the checks of each artifact, which name what they contradict.)"""
  file = pathlib.Path(workdir) / SAVED_CONFIG
  saved = read_json(file, ConfigError) if file.is_file() else None
  if saved is not None and not (isinstance(saved, dict) and {"config", "set", "resolved"} <= set(
      saved)):
    raise ConfigError(f"{file}: not a saved config (config, set and resolved); remove it and "
                      "give --config")
  if spec is None and saved is None:
    raise ConfigError(f"give --config experiments/<name>.py: {workdir} has no saved config "
                      f"({SAVED_CONFIG}, written by the run that makes a workdir)")
  if spec is None:
    config = with_defaults(ml_collections.ConfigDict(saved["resolved"]))
    for override in overrides:
      _override(config, override)
    check_config(config)
    return config
  if saved is not None:
    built = _flat(saved["resolved"], BUILT_WITH)
    try:
      given = load_config(spec, saved["set"])
    except ConfigError:  # the workdir's overrides do not fit that config: another experiment's
      given = load_config(spec)
    now = _flat(given.to_dict(), BUILT_WITH)
    differ = [f"{key} {built.get(key)!r} (--config {spec}: {now.get(key)!r})"
              for key in dict.fromkeys([*built, *now]) if built.get(key) != now.get(key)]
    if differ:
      more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
      raise ConfigError(f"{workdir} was made with another config ({saved['config']}, {file}): "
                        f"{'; '.join(differ[:3])}{more}; leave --config out to use the "
                        "workdir's, or use another --workdir")
  return load_config(spec, overrides)


def _flat(config: dict, keys: Sequence[str]) -> dict:
  """{dotted key: value} of the fields under `keys` (but NOT_BUILT_WITH) of a config's dict."""
  flat = {}

  def walk(prefix: str, value):
    if prefix in NOT_BUILT_WITH:
      return
    if isinstance(value, dict):
      for name, inner in value.items():
        walk(f"{prefix}.{name}", inner)
    else:
      flat[prefix] = value

  for key in keys:
    node = config
    for name in key.split("."):
      node = node.get(name) if isinstance(node, dict) else None
    if node is not None:
      walk(key, node)
  return flat


def _override(config: ml_collections.ConfigDict, override: str) -> None:
  key, sep, raw = override.partition("=")
  if not sep:
    raise ConfigError(f"--set {override!r} is not of the form key=value")
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  node = config
  *parents, leaf = key.split(".")
  for name in parents:
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      raise ConfigError(f"--set {key}: no such config field")
    node = node[name]
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
    raise ConfigError(f"--set {key}: no such config field")
  try:
    node[leaf] = type(node[leaf])(value) if isinstance(node[leaf], float) else value
  except (TypeError, ValueError) as e:
    raise ConfigError(f"--set {key}={raw}: wrong type for this field ({e})") from None


# (field, test, what it must be): values no run can use, refused before any work starts.
_POSITIVE = ("train.batch_size", "train.questions_per_window", "train.keep_checkpoints",
             "eval.batch_size", "eval.max_answer_length", "eval.reader_passages",
             "index.batch_size", "index.top_k",
             "index.nprobe", "index.train_size", "index.shard_passages", "qsft.batch_size",
             "qsft.top_k", "qsft.epochs", "mine.top_k", "filter.batch_size", "filter.epochs",
             "filter.train_windows", "filter.dev_windows", "train.hard_negatives.per_example",
             "data.max_seq_length", "data.doc_stride", "data.max_query_length",
             "serve.max_batch", "serve.max_queue", "serve.max_k",
             "serve.max_questions", "serve.max_question_chars", "serve.shutdown_timeout_s",
             "index.reread_window")
_NOT_NEGATIVE = ("train.num_steps", "train.epochs", "train.stop_at_step", "train.log_every",
                 "train.checkpoint_every", "train.warmup_steps", "eval.limit",
                 "eval.every_steps", "train.loss.prebatch_size", "qsft.limit", "qsft.dev_limit",
                 "mine.limit", "validation.every_steps", "validation.sample_questions",
                 "serve.max_wait_ms", "serve.port", "index.dump_min_context",
                 "index.dump_workers", "index.dump_width_multiple", "index.dump_max_seq_length",
                 "eval.passage_k", "eval.reader_tune_questions", "validation.limit",
                 "filter.sweep_questions", "index.reread", "index.reread_margin",
                 "filter.max_em_drop", "train.seed", "model.seed", "qsft.seed", "filter.seed",
                 "validation.seed")
_LEAST = {"data.max_query_length": 2}  # a question is at least [CLS] [SEP]
_CHOICES = {"train.loss.recipe": ("unified", "original"),
            "eval.checkpoint": ("latest", "best", "qsft"),
            "index.reread_checkpoint": ("latest", "best", "qsft"),
            "index.unit": ("phrase", "sentence", "passage", "document"),
            "qsft.level": ("phrase", "document"),
            "model.dtype": ("float32", "bfloat16"),
            "index.dump_dtype": ("", "float32", "bfloat16"),
            "index.search_device": ("auto", "faiss", "jax")}


def check_config(config: ml_collections.ConfigDict) -> None:
  """Refuses values that cannot work, with the field's name (a ConfigError)."""
  def get(key):
    node = config
    for name in key.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or name not in node:
        return None
      node = node[name]
    return node

  for key in _POSITIVE + _NOT_NEGATIVE:
    value, least = get(key), _LEAST.get(key, 1 if key in _POSITIVE else 0)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or value < least):
      raise ConfigError(f"{key} = {value!r}: must be a number >= {least}")
  for key, choices in _CHOICES.items():
    if get(key) is not None and get(key) not in choices:
      raise ConfigError(f"{key} = {get(key)!r}: must be one of {', '.join(choices)}")
  for key in ("train.learning_rate", "qsft.learning_rate"):
    if get(key) is not None and not get(key) > 0:
      raise ConfigError(f"{key} = {get(key)!r}: must be > 0")
  for key in ("train.grad_clip", "train.weight_decay",  # grad_clip 0: no clipping
              "index.reread_margin"):  # (NaN passes the check above)
    if get(key) is not None and not get(key) >= 0:
      raise ConfigError(f"{key} = {get(key)!r}: must be >= 0")
  for key in ("train.freeze", "qsft.freeze"):
    for pattern in get(key) or ():
      try:
        re.compile(pattern)
      except (re.error, TypeError) as e:
        raise ConfigError(f"{key}: {pattern!r} is not a regular expression ({e})") from None
  fractions = get("filter.keep_fractions")
  if fractions is not None and (not len(fractions) or not all(
      isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1 for f in fractions)):
    raise ConfigError(f"filter.keep_fractions = {list(fractions)!r}: must be one or more "
                      "fractions in (0, 1]")
  warmup = get("train.warmup_fraction")
  if warmup is not None and not 0 <= warmup < 1:
    raise ConfigError(f"train.warmup_fraction = {warmup!r}: must be in [0, 1)")
  if get("index.sparse_sentence_weight") is not None and get("index.sparse_weight") is None:
    raise ConfigError("index.sparse_sentence_weight is set without index.sparse_weight: set both, "
                      "or neither (`run.py index` chooses both)")
  for key in ("index.reread_margin", "index.reread_window", "index.reread_checkpoint"):
    if get(key) is not None and not get("index.reread"):
      raise ConfigError(f"{key} is set without index.reread: set index.reread to the most "
                        "passages a question may re-read")
  if get("index.dump_vectors") is False and not get("index.dump_codec"):
    raise ConfigError("index.dump_vectors = False without an index.dump_codec: the dump would "
                      "store no vector; set index.dump_codec (e.g. \"compact\")")
  if get("index.dump_codec") and not _is_codec(get("index.dump_codec")):
    raise ConfigError(f"index.dump_codec = {get('index.dump_codec')!r}: must be \"compact\" or a "
                      "faiss codec of flat codes (PQ32, OPQ32,PQ32, RQ24x8, SQ8, SQfp16), "
                      "optionally after qw:, pr: or qw+pr: (docs/indexing.md)")
  if get("train") is not None and not config.train.num_steps and not config.train.epochs:
    raise ConfigError("train.num_steps and train.epochs are both 0: nothing to train")


def _is_codec(codec) -> bool:
  """Whether `index.dump_codec` reads as a codec (its training checks the rest)."""
  return isinstance(codec, str) and (codec == "compact" or bool(re.fullmatch(
      r"((qw|pr|qw\+pr):)?(OPQ\d+(_\d+)?,)?(PQ\d+(x\d+)?|(RQ|LSQ)\d+x\d+|SQ(4|6|8|fp16|bf16)"
      r"|Flat)", codec)))


# Pieces shared by the experiment configs in experiments/.
# Loggers whose INFO lines are the libraries' own business, kept out of the default output.
LIBRARY_CHATTER = ("faiss.loader", "absl", "jax._src.xla_bridge")


def setup_logging(*quiet: str, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s",
                  debug: bool = False, verbose: bool = False):
  """INFO logging for the command line and scripts, without the libraries' loader chatter (plus
  the `quiet` loggers): faiss's attempts at each CPU build ("Could not load library with AVX2
  support ... ModuleNotFoundError", which reads like a failure but is not), Orbax's per-save
  messages (absl) and JAX's backend probing; `verbose` keeps them. dpjax's DEBUG messages too
  with `debug`. dpjax's own INFO lines (the progress of every long stage) always show."""
  logging.basicConfig(level=logging.INFO, format=fmt)
  if debug:
    logging.getLogger("dpjax").setLevel(logging.DEBUG)
  for noisy in (() if verbose else LIBRARY_CHATTER) + quiet:
    logging.getLogger(noisy).setLevel(logging.WARNING)


def model_config(name: str = "minilm-l6") -> ml_collections.ConfigDict:
  """The model section: pretrained weights `name` (a known name, a local folder or a hub id)."""
  return ml_collections.ConfigDict({
      "init": "pretrained",  # or "random" (uses `random`), for tests
      "name": name,  # local dir, alias (minilm-l6) or Hugging Face Hub id
      "tokenizer": name,  # follows --set model.name unless set itself
      "share_query_encoders": False,
      "dtype": "float32",  # compute dtype: float32 or bfloat16
      "seed": 0,
      # A tiny random encoder (odd sizes so shape bugs show), used by `:tiny` configs.
      "random": {"vocab_size": 30522, "hidden_size": 30, "num_hidden_layers": 2,
                 "num_attention_heads": 3, "intermediate_size": 37,
                 "max_position_embeddings": 512},
  })


def base_config(data: dict, *, train: dict, index: dict | None = None, eval_batch_size: int,
                model: str = "minilm-l6") -> ml_collections.ConfigDict:
  """The sections every experiment has, each from its function with the experiment's
  settings (`train`, `index`: keyword overrides), and its `data` section as given: what
  experiments/demo.py and experiments/squad.py share."""
  config = ml_collections.ConfigDict()
  config.model = model_config(model)
  config.data = ml_collections.ConfigDict(data)
  config.train = train_config(**train)
  config.index = index_config(**(index or {}))
  config.validation = validation_config()
  config.mine = mine_config()
  config.qsft = qsft_config()
  config.filter = filter_config()
  config.eval = eval_config(batch_size=eval_batch_size)
  config.serve = serve_config()
  return config


def make_tiny(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks a config to a seconds-long CPU run of the same code path."""
  config.model.init = "random"
  config.eval.batch_size = 8
  if "train" in config:
    config.train.update(batch_size=8, num_steps=6, log_every=1, checkpoint_every=3,
                        progress_bar=False)
    config.train.loss.prebatch_warmup_steps = 2
  return config


def train_config(**overrides) -> ml_collections.ConfigDict:
  """Training defaults: the unified loss of Kim et al. with DensePhrases' optimiser."""
  config = ml_collections.ConfigDict({
      "seed": 0,
      "batch_size": 24,  # examples (with questions_per_window > 1: windows) per step
      # Passage-grouped batches: up to this many questions of each window in a batch, the window
      # encoded once for all of them (unified loss only). 1: one question per example.
      "questions_per_window": 1,
      "num_steps": 0,  # 0: `epochs` epochs
      "epochs": 2,
      "stop_at_step": 0,  # stop early (the schedule still assumes num_steps); 0: never
      "learning_rate": 3e-5,
      "warmup_steps": 0,  # 0: warmup_fraction of the steps
      "warmup_fraction": 0.1,
      "weight_decay": 0.0,  # AdamW's, not on biases and LayerNorm scales (as the reference)
      "grad_clip": 1.0,  # global gradient norm; 0: no clipping
      # Parameter-path regexes (e.g. 'phrase_encoder/.*') whose parameters are not trained.
      # The reference freezes the word embeddings.
      "freeze": ["word_embeddings"],
      "dropout": True,
      "log_every": 20,
      "checkpoint_every": 500,
      "keep_checkpoints": 2,
      "progress_bar": True,
      # Mined hard negatives (`run.py mine`): h passages per example, all their tokens N_hard.
      "hard_negatives": {"file": "", "per_example": 1},
      # Distillation: the directory of `run.py teacher`'s logits, relative to the workdir
      # ("teacher/logits"; it covers the examples of every step of this run); empty: none.
      "teacher_logits": "",
      "loss": {
          "recipe": "unified",  # or "original"
          # unified (Kim et al. Eq. 2): lambda of each negative type; 0 switches a type off.
          "lambda_inp": 1.0, "lambda_inb": 256.0, "lambda_prb": 0.0,  # 0: same as lambda_inb
          "lambda_hard": 1.0,
          "lambda_distill": 2.0,  # x KL to the teacher's logits, with train.teacher_logits
          # Question vectors x this in the loss (a softmax temperature of 1/scale over the phrase
          # scores); search rankings do not depend on it.
          "score_scale": 1.0,
          # original (DensePhrases): L = 1 L_single + 2 L_distill + 4 L_neg.
          "weight_single": 1.0, "weight_distill": 2.0, "weight_negatives": 4.0,
          "weight_filter": 0.0,  # joint filter training (Kim et al. train it separately)
          "prebatch_size": 2,  # C previous batches; 0: no pre-batch negatives
          "prebatch_warmup_steps": 0,
          "clear_prebatch_each_epoch": True,
          # Also train on the windows that do not hold the question's whole answer (17% of SQuAD
          # train's features at 192/64), [CLS] their target, as the reference does; [CLS] is then
          # a candidate token of every window. False: only windows with the answer are trained.
          "windows_without_answer": False,
      },
  })
  config.update(overrides)
  return config


def validation_config(**overrides) -> ml_collections.ConfigDict:
  """Validation on a subcorpus during training (off unless `corpus` and `every_steps` are set)."""
  config = ml_collections.ConfigDict({
      "corpus": "",  # a subcorpus file (`run.py subcorpus` writes C0, R_r, H_k)
      "questions": "",  # dev questions; empty: the corpus's own (its .meta.json), else dev
      "every_steps": 0,
      "metric": "em@1",  # selects the best checkpoint (workdir/checkpoints_best)
      "limit": 0,  # use only the first N questions (0: all)
      # `run.py subcorpus`: build C0 / H_k for N dev questions drawn at random (seeded; 0: all);
      # the sample is written beside the subcorpora (questions_n<N>_seed<S>.json) and recorded
      # in their meta.
      "sample_questions": 0,
      # `run.py subcorpus`: which subcorpora to write, the full index and depth for H_k.
      "kinds": ["C0", "R0.1", "R0.333", "H1", "H2", "H4", "H8", "H16", "H32"],
      "seed": 0,
  })
  config.update(overrides)
  return config


def eval_config(**overrides) -> ml_collections.ConfigDict:
  """Evaluation: RC EM/F1 (train, `run.py eval_rc`) and open-domain (`run.py eval`)."""
  config = ml_collections.ConfigDict({
      "batch_size": 64,
      "max_answer_length": 10,
      "limit": 0,  # only the first N questions (0: all)
      "every_steps": 0,  # RC evaluation during training (0: at the end only)
      "checkpoint": "latest",  # latest, best (validation) or qsft
      "passage_k": 100,  # passage Top-1/5/20/100 up to k, MRR and P@ at 20 (or k if less)
      # The questions' answers are regular expressions (CuratedTREC): `run.py eval` and QSFT's
      # dev scores match them as DrQA / DPR do (EM: matched at the prediction's start; no F1;
      # passages: searched). Training and QSFT's positives take answers as text.
      "regex": False,
      # dump / index / search / eval refuse a workdir without checkpoints (a mistyped --workdir
      # would otherwise use the untrained weights) unless this is set.
      "allow_untrained": False,
      # `run.py eval`'s throughput: consecutive batches of 64 of the first N questions (at
      # least 64), encoding included, as a service sees them.
      "throughput_questions": 1280,
      # The retriever-reader pipeline (dpjax/reading.py): a workdir holding a `run.py teacher`
      # reader, which then reads each question's top reader_passages passages; its answers
      # mix the reader's and the index's scores with weight reader_mu (unset: chosen on
      # reader_tune_questions random training questions). Empty: off.
      "reader": "",
      "reader_passages": 10,
      "reader_mu": ml_collections.config_dict.placeholder(float),
      "reader_tune_questions": 500,
  })
  config.update(overrides)
  return config


def serve_config(**overrides) -> ml_collections.ConfigDict:
  """`run.py serve`: the HTTP search service over the workdir's index."""
  config = ml_collections.ConfigDict({
      "host": "127.0.0.1",  # 0.0.0.0 to listen on every interface (needs an API key)
      "port": 8000,
      # With a key, every route but /health, / and the docs needs `Authorization: Bearer <key>`.
      # The environment variable keeps the key out of command lines and config files.
      "api_key": "",
      "api_key_env": "DPJAX_API_KEY",  # the variable holding the key when api_key is empty
      "allow_open": False,  # listen beyond loopback without a key, on purpose
      "shutdown_timeout_s": 30,  # on SIGTERM/SIGINT, the longest wait for requests it holds
      "index": "",  # index name under <dump>/indexes; empty: index.search_index
      # Micro-batching: the requests waiting when the search thread is free share one question
      # encoding, up to max_batch questions; it waits at most max_wait_ms for more to arrive.
      "max_batch": 64,
      "max_wait_ms": 2.0,
      "max_queue": 1024,  # requests waiting beyond this are refused (503), not queued
      "max_k": 100,
      "max_questions": 64,  # per request
      "max_question_chars": 1000,
  })
  config.update(overrides)
  return config


def qsft_config(**overrides) -> ml_collections.ConfigDict:
  """`run.py qsft`: query-side fine-tuning on the workdir's index (DensePhrases defaults)."""
  config = ml_collections.ConfigDict({
      "index": "Flat",  # index (under <dump>/indexes) to retrieve from
      "quantized": False,  # candidates as the index's quantizer reconstructs them (IVF-SQ/PQ)
      "level": "phrase",  # positives: 'phrase' (text = gold answer) or 'document' (L_doc)
      "top_k": 100,
      "epochs": 2,
      "batch_size": 12,
      "learning_rate": 3e-5,
      "dropout": True,
      # Everything but the question encoders stays as it is (the index depends on it).
      "freeze": ["phrase_encoder/", "filter_head/", "word_embeddings"],
      "questions": "",  # training questions (SQuAD or open-QA JSON/JSONL); empty: train split
      "limit": 0,  # train on N training questions drawn at random (0: all)
      "dev_limit": 0,  # evaluate on N dev questions drawn at random (0: all)
      "seed": 0,  # of those draws
  })
  config.update(overrides)
  return config


def filter_config(**overrides) -> ml_collections.ConfigDict:
  """`run.py filter`: the token filter trained on frozen phrase vectors, and its sweep."""
  config = ml_collections.ConfigDict({
      "train_windows": 4000,  # training windows (with an answer) whose vectors train the head
      "dev_windows": 1000,  # dev windows for AUC-PR
      # A linear probe from zero: ~30 steps per epoch at the CPU settings; AUC-PR was still
      # rising steeply after 5 epochs on SQuAD (results/filter.md); the best epoch is kept.
      "epochs": 50,
      "batch_size": 64,
      "learning_rate": 1e-3,
      "seed": 0,
      # The sweep: thresholds keeping these fractions of the dump's tokens.
      "keep_fractions": [1.0, 0.75, 0.5, 0.4, 0.3, 0.2, 0.1],
      "sweep_questions": 0,  # dev questions for the sweep, drawn at random (0: all)
      "max_em_drop": 1.0,  # the chosen threshold loses at most this much EM@1
  })
  config.update(overrides)
  return config


def mine_config(**overrides) -> ml_collections.ConfigDict:
  """`run.py mine`: hard negatives of the training questions from the model's full index."""
  config = ml_collections.ConfigDict({
      "top_k": 10,  # phrases retrieved per question (Kim et al.: 10)
      "out": "hard_negatives.jsonl",  # relative to the workdir
      "limit": 0,  # mine only the first N training questions (0: all)
  })
  config.update(overrides)
  return config


def _dump_kept_defaults() -> dict:
  """`index_config`'s dump-time filtering and coding (`dpjax.index.dump_codes`)."""
  return {
      # Tokens kept at dump time: those whose start or end filter logit (the workdir's head,
      # `run.py filter`) reaches it; None: every token. Dropped tokens never reach the disk.
      "dump_filter_threshold": ml_collections.config_dict.placeholder(float),
      # A compact codec ("OPQ32,PQ32", "qw+pr:OPQ24,PQ24", "compact": compact.default_codec)
      # the dump trains on train_size kept tokens of passages drawn across the corpus and codes
      # every shard with ("": none): `run.py index` then assembles the compact index from the
      # codes, nothing re-encoded.
      "dump_codec": "",
      # Whether the dump stores float16 vectors (768 B/token for MiniLM); False needs a
      # dump_codec, and leaves out what reads vectors (Flat/IVF, qsft, filter, subcorpora).
      "dump_vectors": True,
  }


def _ranking_defaults() -> dict:
  """The index section's settings of how a search ranks its spans: hybrid search, merged spans
  and re-reading."""
  return {
      # Hybrid search (dpjax/index/hybrid.py): a phrase scores its dense score + sparse_weight x
      # its passage's BM25 score + sparse_sentence_weight x its sentence's, and the spans of the
      # top sparse_passages BM25 passages join the candidates. `run.py index` builds the BM25
      # index (<dump>/indexes/bm25) and, without a sparse_weight, chooses both weights on
      # sparse_tune_questions random training questions (or those of sparse_tune_file) and
      # records them there; with one, the sentence weight is sparse_sentence_weight (None: 0).
      "sparse": False,
      "sparse_weight": ml_collections.config_dict.placeholder(float),
      "sparse_sentence_weight": ml_collections.config_dict.placeholder(float),
      "sparse_passages": 20,
      "sparse_tune_questions": 1000,
      "sparse_tune_file": "",
      "merge_spans": True,  # overlapping spans of one passage: one result, the others merged
      # Each question's top `reread` passages encoded again, their spans scored exactly (0:
      # none; dpjax/index/rereading.py): for a compact or filtered index. With reread_margin,
      # only those holding a span ranked within it of the best, none when the best leads by it;
      # with reread_window, a passage only around its best span (that many word pieces).
      "reread": 0,
      "reread_margin": ml_collections.config_dict.placeholder(float),
      "reread_window": ml_collections.config_dict.placeholder(int),
      # The checkpoint (latest, best, qsft) whose question encoder scores the re-read spans;
      # None: eval.checkpoint's, which also ranks the candidates. E.g. QSFT's encoder, tuned to
      # the codes, picks the passages and the trained one, the phrase encoder's partner, scores.
      "reread_checkpoint": ml_collections.config_dict.placeholder(str),
  }


# Passages (a residual compact index) or IVF lists an approximate search visits per query.
DEFAULT_NPROBE = 256


def index_config(**overrides) -> ml_collections.ConfigDict:
  """Dump / index / search settings."""
  config = ml_collections.ConfigDict({
      "corpus": [],  # corpus files (SQuAD JSON or JSONL); empty: the data set's corpus.json
      "dump_name": "dump",  # the dump (and its indexes) live in <workdir>/<dump_name>
      "questions": "",  # evaluation questions; empty: the dev split
      "batch_size": 64,
      "shard_passages": 2000,
      # The dump's windows: 0 = every data.doc_stride tokens (as in training); n > 0 = as few
      # as keep n tokens of context on each side of every token (fewer tokens encoded twice).
      "dump_min_context": 0,
      # The dump's window length: 0 = data.max_seq_length, as the model was trained. Longer
      # windows (at most the model's max_position_embeddings) split fewer passages, so fewer
      # tokens are encoded twice, but a model trained at 192 then retrieves worse (lower EM@1
      # at 256 and 384 on SQuAD dev: results/dump_window_length.md).
      "dump_max_seq_length": 0,
      # Processes tokenizing the dump's shards ahead of the encoder (0: one thread, slower
      # than an accelerator encodes: use several there; each takes seconds to start;
      # dpjax.index.window_maker.WindowMaker; results/code_measurements.md).
      "dump_workers": 0,
      # The dump encoder's compute dtype: "" = model.dtype; "bfloat16" halves a float32 model's
      # products (vectors stored float16 either way; the manifest records which).
      "dump_dtype": "",
      # The dump's call widths: its calls' longest window rounded up to this; 0 = the
      # platform's (32 on an accelerator, 16 on a CPU). Each width compiles once.
      "dump_width_multiple": 0,
      **_dump_kept_defaults(),  # dump-time filtering and coding
      "specs": ["Flat"],  # faiss factory strings: Flat, IVFauto,SQ4, OPQ96,IVFauto,PQ96x8 ...
      "nprobe": DEFAULT_NPROBE,
      "train_size": 1_000_000,  # vectors sampled to train IVF / PQ / OPQ quantizers
      "filter_threshold": ml_collections.config_dict.placeholder(float),
      "search_index": "Flat",  # index name (directory under dump/indexes) for search and eval
      # Where a Flat index is searched: "auto" = on the accelerator when there is one (JAX, the
      # vectors in at most half its memory), else by faiss on the host; "jax"; "faiss".
      "search_device": "auto",
      # serve and eval check every byte of the checkpoint, dump and index they load against the
      # digests recorded when these were written (file sizes are checked by every load); False
      # skips it, for indexes too large to read twice at start (cost: results/integrity.md).
      "verify": True,
      "top_k": 5,
      "unit": "phrase",
      **_ranking_defaults(),  # hybrid search and re-reading
  })
  config.update(overrides)
  return config


# Each section's defaults, declared once: its function above. A config that lacks a field of a
# section it has (one saved in a workdir by an older dpjax, or an experiment's section built
# without the function) gets the default when it is loaded (`with_defaults`), so that no reader
# repeats a default (`config.x.get(key, default)`).
SECTIONS = {"train": train_config, "validation": validation_config, "eval": eval_config,
            "serve": serve_config, "qsft": qsft_config, "filter": filter_config,
            "mine": mine_config, "index": index_config}


def with_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with the fields its sections lack set to their defaults (`SECTIONS`); returned."""
  def fill(node: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict) -> None:
    for key in defaults:
      if key not in node:
        node[key] = defaults.get_ref(key) if defaults[key] is None else defaults[key]
      elif isinstance(node[key], ml_collections.ConfigDict) and isinstance(
          defaults[key], ml_collections.ConfigDict):
        fill(node[key], defaults[key])

  for name, make in SECTIONS.items():
    if isinstance(config.get(name), ml_collections.ConfigDict):
      fill(config[name], make())
  return config
