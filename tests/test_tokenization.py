"""The tokenizer wrapper: offsets back to the text, and no hidden padding or truncation."""
import numpy as np


def test_offsets_map_back_to_text(tokenizer):
  text = "Zürich's population was 415,367 in 2020 (the largest in Switzerland)."
  ids, offsets = tokenizer.tokenize([text])[0]
  assert len(ids) == len(offsets) > 10
  pieces = [text[s:e] for s, e in offsets]
  assert "".join(pieces).lower() == "".join(text.split()).lower()


def test_no_truncation_or_padding_at_128(tokenizer):
  text = " ".join(f"word{i}" for i in range(400))
  ids, _ = tokenizer.tokenize([text])[0]
  assert len(ids) > 400  # the bundled tokenizer.json would truncate at 128
  short, _ = tokenizer.tokenize(["hello"])[0]
  assert len(short) == 1  # and pad to 128


def test_encode_pads_and_truncates_to_the_requested_length(tokenizer):
  ids, mask = tokenizer.encode(["a b c", " ".join(["word"] * 50)], 9)
  assert ids.shape == mask.shape == (2, 9)
  np.testing.assert_array_equal(mask[0], [1, 1, 1, 1, 1, 0, 0, 0, 0])
  assert ids[0, 0] == tokenizer.cls_id and ids[0, 4] == tokenizer.sep_id
  assert ids[0, 5] == tokenizer.pad_id
  assert ids[1, -1] == tokenizer.sep_id and mask[1].all()


def test_the_tokenizer_loads_without_jax():
  """What the dump's window-making worker processes import (`dpjax.data.windows.windows_worker`):
  no JAX, Flax or faiss start there."""
  import subprocess
  import sys
  from conftest import REPO
  code = ("import sys; from dpjax.data.tokenization import Tokenizer; "
          "from dpjax.data.windows import windows_worker; "
          "Tokenizer.from_pretrained('minilm-l6').tokenize(['a b']); "
          "print(sorted(m for m in ('jax', 'flax', 'faiss', 'optax') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"


def test_token_ends_take_the_combining_marks_after_them(tokenizer):
  """The uncased tokenizer strips accents: a decomposed "Cafe\u0301" is one token whose offsets
  ended before the accent, so an answer cut at that end lost it. Ends now take the marks that
  follow them unless a token holds those marks (a spacing vowel sign is a token of its own)."""
  from dpjax import metrics
  for text, want in (("the Cafe\u0301 is open", ["the", "Cafe\u0301", "is", "open"]),
                     ("the Caf\u00e9 is open", ["the", "Caf\u00e9", "is", "open"]),
                     ("ab \u0301 cd", ["ab", "cd"]),  # a mark after a space: no token's
                     ("\u0915\u094d\u092f\u093e", ["\u0915\u094d", "\u092f", "\u093e"])):
    _, offsets = tokenizer.tokenize([text])[0]
    assert [text[a:b] for a, b in offsets] == want, text
  _, offsets = tokenizer.tokenize(["the Cafe\u0301 is open"])[0]
  answer = "the Cafe\u0301 is open"[offsets[1, 0]:offsets[1, 1]]
  assert metrics.exact_match(answer, "Caf\u00e9".replace("\u00e9", "e\u0301")) == 1.0
