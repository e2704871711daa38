"""`run.py export`: the trained encoders as Hugging Face BERT folders that load back."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from dpjax.config import load_config
from dpjax.models import load_exported, load_pretrained_bert
from dpjax.main import restore
from dpjax.settings import Settings

import run


def _leaves(module):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module, nnx.Param))]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  workdir, out = tmp_path_factory.mktemp("w"), tmp_path_factory.mktemp("x") / "export"
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  assert run.main(["train"] + base) == 0
  assert run.main(["export"] + base) == 2  # no --out: one line, exit 2
  assert run.main(["export"] + base + ["--out", str(out)]) == 0
  assert run.main(["export"] + base + ["--out", str(out)]) == 0  # an earlier export: replaced
  # Any other existing folder (the workdir itself, a typo) would be replaced whole: refused.
  assert run.main(["export"] + base + ["--out", str(workdir)]) == 2
  assert (workdir / "checkpoints").is_dir() and (workdir / "metrics.jsonl").is_file()
  model, step = restore(Settings.of(load_config("experiments/demo.py:tiny")), workdir)
  return model, step, out


def test_export_loads_back_bit_for_bit(exported):
  model, step, out = exported
  info = json.loads((out / "densephrases.json").read_text())
  assert info["step"] == step and info["encoders"]["query_end"] == "query_end"
  for name in ("phrase", "query_start", "query_end"):
    assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.txt"} <= {
        p.name for p in (out / name).iterdir()}
  again = load_exported(out)
  for a, b in zip(_leaves(model), _leaves(again)):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_each_folder_is_a_bert_checkpoint(exported):
  model, _, out = exported
  ids = np.array([[101, 7592, 2088, 2003, 1037, 3231, 102, 0]], np.int32)
  mask = (ids > 0).astype(np.int32)
  for name, encoder in (("phrase", model.phrase_encoder),
                        ("query_start", model.query_start_encoder),
                        ("query_end", model.query_end_encoder)):
    bert = load_pretrained_bert(str(out / name))
    np.testing.assert_array_equal(np.asarray(bert(ids, mask)), np.asarray(encoder(ids, mask)))


def test_transformers_bert_model_gives_the_same_vectors(exported):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model, _, out = exported
  ids = np.array([[101, 7592, 2088, 2003, 1037, 3231, 102, 0]], np.int64)
  mask = (ids > 0).astype(np.int64)
  hf = transformers.BertModel.from_pretrained(str(out / "phrase")).eval()
  with torch.no_grad():
    theirs = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state
  ours = np.asarray(model.phrase_encoder(ids.astype(np.int32), mask.astype(np.int32)))
  np.testing.assert_allclose(theirs.numpy()[mask > 0], ours[mask > 0], atol=1e-5)
