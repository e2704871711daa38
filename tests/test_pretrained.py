"""Checkpoint loading: parity with Hugging Face's PyTorch BertModel, and clear errors."""
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from dpjax.models import pretrained
from dpjax.errors import CheckpointError

REFERENCE = FIXTURES / "minilm_reference.npz"  # made by tests/fixtures/make_bert_reference.py
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
  return np.load(REFERENCE)


@pytest.fixture(scope="module")
def minilm():
  return pretrained.load_pretrained_bert("minilm-l6")


def test_tokenizer_matches_hugging_face(tokenizer, reference):
  for i, text in enumerate(reference["texts"]):
    ids, offsets = tokenizer.tokenize([str(text)])[0]
    expected = reference[f"single_{i}_input_ids"]
    np.testing.assert_array_equal(np.concatenate([[tokenizer.cls_id], ids, [tokenizer.sep_id]]),
                                  expected)


def test_single_sentences_match_pytorch(minilm, reference):
  lengths = []
  for i in range(len(reference["texts"])):
    ids = reference[f"single_{i}_input_ids"]
    lengths.append(len(ids))
    ours = np.asarray(minilm(jnp.asarray(ids)[None]))[0]
    assert np.abs(ours - reference[f"single_{i}_hidden"]).max() <= TOLERANCE
  assert len(set(lengths)) == len(lengths) >= 3  # sentences of different lengths


def test_padded_batch_matches_pytorch(minilm, reference):
  ids, mask = reference["batch_input_ids"], reference["batch_attention_mask"]
  assert (mask == 0).any()  # the batch really is padded
  ours = np.asarray(minilm(jnp.asarray(ids), jnp.asarray(mask)))
  real = mask.astype(bool)
  assert np.abs(ours - reference["batch_hidden"])[real].max() <= TOLERANCE


def test_token_types_match_pytorch(minilm, reference):
  ids, types = reference["pair_input_ids"], reference["pair_token_type_ids"]
  assert types.max() == 1
  ours = np.asarray(minilm(jnp.asarray(ids)[None], None, jnp.asarray(types)[None]))[0]
  assert np.abs(ours - reference["pair_hidden"]).max() <= TOLERANCE


def _copy_checkpoint(src: pathlib.Path, dst: pathlib.Path, edit=None) -> pathlib.Path:
  dst.mkdir()
  shutil.copy(src / "config.json", dst / "config.json")
  tensors = load_file(src / "model.safetensors")
  if edit:
    edit(tensors)
  save_file(tensors, dst / "model.safetensors")
  return dst


def test_missing_mismatched_unexpected_tensors_are_listed(minilm_dir, tmp_path):
  def edit(t):
    del t["encoder.layer.2.attention.self.key.bias"]
    t["encoder.layer.0.output.dense.weight"] = np.zeros((384, 100), np.float32)
    t["encoder.layer.9.extra.weight"] = np.zeros(3, np.float32)
  bad = _copy_checkpoint(minilm_dir, tmp_path / "bad", edit)
  with pytest.raises(CheckpointError) as info:
    pretrained.load_pretrained_bert(str(bad))
  message = str(info.value)
  assert "1 missing: encoder.layer.2.attention.self.key.bias" in message
  assert "encoder.layer.0.output.dense.weight: checkpoint (100, 384) vs model (1536, 384)" \
      in message
  assert "encoder.layer.9.extra.weight" in message


def test_bert_prefix_and_local_directory(minilm_dir, tmp_path, minilm, reference):
  prefixed = _copy_checkpoint(
      minilm_dir, tmp_path / "prefixed",
      lambda t: t.update({f"bert.{k}": t.pop(k) for k in list(t)}))
  model = pretrained.load_pretrained_bert(str(prefixed))
  ids = jnp.asarray(reference["single_0_input_ids"])[None]
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(minilm(ids)))


def test_pytorch_bin_without_torch_is_a_clear_error(minilm_dir, tmp_path):
  try:
    import torch  # noqa: F401
    pytest.skip("torch is installed here")
  except ImportError:
    pass
  d = tmp_path / "bin"
  d.mkdir()
  shutil.copy(minilm_dir / "config.json", d / "config.json")
  (d / "pytorch_model.bin").write_bytes(b"not really")
  with pytest.raises(CheckpointError, match="pytorch_model.bin.*torch is not installed"):
    pretrained.load_tensors(d)


def test_resolution(minilm_dir, tmp_path, monkeypatch):
  assert pretrained.resolve_model_dir("minilm-l6") == minilm_dir
  assert (minilm_dir / "model.safetensors").is_file()
  assert pretrained.resolve_model_dir(str(minilm_dir)) == minilm_dir
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(CheckpointError, match="no-such-org/no-such-model.*Hugging Face Hub"):
    pretrained.resolve_model_dir("no-such-org/no-such-model")
  (tmp_path / "empty").mkdir()
  with pytest.raises(CheckpointError, match="no config.json"):
    pretrained.resolve_model_dir(tmp_path / "empty")
  (tmp_path / "noweights").mkdir()
  shutil.copy(minilm_dir / "config.json", tmp_path / "noweights" / "config.json")
  with pytest.raises(CheckpointError, match="no weights found"):
    pretrained.load_tensors(tmp_path / "noweights")


def test_hub_repo_with_pytorch_weights_only_fetches_them(tmp_path, monkeypatch):
  """A Hub repo without safetensors (SpanBERT's has pytorch_model.bin only) is fetched again
  with its PyTorch weights allowed; a repo with safetensors is fetched once."""
  import huggingface_hub
  calls = []

  def snapshot_download(repo_id, allow_patterns):
    calls.append(allow_patterns)
    folder = tmp_path / repo_id.replace("/", "--")
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    if "safe" in repo_id:
      (folder / "model.safetensors").write_bytes(b"")
    elif "pytorch_model.bin" in allow_patterns:
      (folder / "pytorch_model.bin").write_bytes(b"")
    return str(folder)

  monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
  path = pretrained.resolve_model_dir("org/bin-only")
  assert (path / "pytorch_model.bin").is_file() and len(calls) == 2
  assert "pytorch_model.bin" not in calls[0] and "pytorch_model.bin" in calls[1]
  calls.clear()
  assert (pretrained.resolve_model_dir("org/safe") / "model.safetensors").is_file()
  assert len(calls) == 1
