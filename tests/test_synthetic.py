"""The embedded synthetic data set: deterministic, readable, held-out dev entities."""
import json
import re

from dpjax.data import read_squad
from dpjax.data.synthetic import generate, write_synthetic


def _names(split):
  names = set()
  for article in split["data"]:
    names.add(article["title"])
    for paragraph in article["paragraphs"]:
      for qa in paragraph["qas"]:
        if qa["id"].endswith(("sibling", "mentor", "spouse")):
          names.add(qa["answers"][0]["text"])
  return names


def test_deterministic():
  a = json.dumps(generate(seed=3, num_train_entities=5, num_dev_entities=3))
  b = json.dumps(generate(seed=3, num_train_entities=5, num_dev_entities=3))
  c = json.dumps(generate(seed=4, num_train_entities=5, num_dev_entities=3))
  assert a == b and a != c


def test_dev_entities_are_held_out():
  splits = generate(seed=0, num_train_entities=40, num_dev_entities=15)
  train, dev = _names(splits["train"]), _names(splits["dev"])
  assert len(dev) >= 15 and not train & dev
  train_text = " ".join(p["context"] for a in splits["train"]["data"] for p in a["paragraphs"])
  assert not any(name in train_text for name in dev)


def test_answers_are_located_and_questions_name_their_entity(tmp_path):
  paths = write_synthetic(tmp_path, seed=1, num_train_entities=12, num_dev_entities=5)
  for split in ("train", "dev"):
    passages, questions, summary = read_squad(paths[split])
    assert summary.total == 0 and summary.answers_relocated == 0
    assert len(questions) >= 5 * 5
    for q in questions:
      passage = passages[q.passage_index]
      assert passage.context[q.answer_start:q.answer_start + len(q.answers[0])] == q.answers[0]
      assert passage.title in q.question
  corpus, questions, _ = read_squad(paths["corpus"], require_answers=False)
  assert not questions and len(corpus) == 3 * (12 + 5)
  assert not list(tmp_path.glob("*.tmp"))


def test_distractors_share_the_answer_type():
  """Birth-year questions have other years in the same paragraph: the model has to read."""
  splits = generate(seed=0, num_train_entities=20, num_dev_entities=5)
  checked = 0
  for article in splits["train"]["data"]:
    for paragraph in article["paragraphs"]:
      for qa in paragraph["qas"]:
        if qa["id"].endswith("birth_year"):
          years = set(re.findall(r"\b1[7-9]\d\d\b|\b20\d\d\b", paragraph["context"]))
          assert len(years - {qa["answers"][0]["text"]}) >= 2
          checked += 1
  assert checked > 0
