"""The embedded default data set: a deterministic, Wikipedia-like corpus with RC questions.

Every entity is a fictional person with random attributes (birth year and city, the city they grew
up in, a sibling, a university, a mentor, a work, an award, a spouse, death year and city). Each
entity gets three paragraphs written from templates, and every paragraph also states facts of the
same type about *other* people (a sibling's birth year, a rival's work, a colleague's award), so
that answering needs the question's entity to be found and read, not just an answer type.

Train and dev use disjoint entities (dev names never occur in train), and attribute values are
drawn independently per entity, so dev accuracy measures reading, not memorisation. Answers are
located by construction (exact character offsets), and each question names its entity, so it has
one answer across the whole corpus (open-domain use).

`python -m dpjax.data.synthetic --out DIR` writes train.json, dev.json (SQuAD v1.1 format) and
corpus.json (all paragraphs, no questions).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
from typing import Any

from dpjax.io import write_text_atomic

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "r",
           "s", "st", "t", "tr", "v", "w", "z", "th", "ch", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia", "ae"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "lt", "x"]
_CITIES = ["Avenmoor", "Brelton", "Castavia", "Dunmere", "Eskholm", "Farrowgate", "Galdon",
           "Halvik", "Istrana", "Jorvale", "Kestrel Bay", "Lunedor", "Marrowick", "Norhaven",
           "Ostemark", "Pellinore", "Quarry Hill", "Ravensfield", "Selmoor", "Tarnwick",
           "Ulverin", "Valdessa", "Westmarch", "Yarrowby", "Zennor", "Ashbury", "Blackwater",
           "Coldharbour", "Drummond", "Elderglen", "Fenwick", "Greystone", "Highmere", "Ironbridge",
           "Juniper Falls", "Kingsreach", "Longford", "Millbrook", "Northcliff", "Oakhollow"]
_NATIONALITIES = ["Avenish", "Brelish", "Castavian", "Dunmeric", "Eskish", "Galdonian",
                  "Halvish", "Istranan", "Jorvalese", "Lunedorian"]
_OCCUPATIONS = ["painter", "chemist", "composer", "architect", "astronomer", "novelist",
                "mathematician", "sculptor", "botanist", "engineer", "physician", "poet",
                "geologist", "economist", "philosopher", "cartographer"]
_AWARDS = ["Halden Prize", "Order of the Silver Oak", "Marrow Medal", "Veldt Award",
           "Crown of Letters", "Istrana Fellowship", "Gold Compass", "Lantern Prize",
           "Aster Medal", "Royal Quill", "Beacon Award", "Northern Star Prize"]
_ADJECTIVES = ["Silent", "Crimson", "Distant", "Hollow", "Golden", "Broken", "Endless", "Quiet",
               "Winter", "Hidden", "Burning", "Pale", "Second", "Last", "Northern", "Glass"]
_NOUNS = ["Harbor", "Orchard", "Cathedral", "Lantern", "River", "Meridian", "Garden", "Tower",
          "Archive", "Symphony", "Atlas", "Equation", "Mirror", "Bridge", "Voyage", "Engine"]
_UNIVERSITY_FORMS = ["University of {}", "{} Institute of Technology", "{} College",
                     "Royal Academy of {}"]


class _Paragraph:
  """Builds a paragraph from pieces, remembering where each answer slot starts."""

  def __init__(self):
    self.parts: list[str] = []
    self.slots: dict[str, tuple[str, int]] = {}
    self.length = 0

  def add(self, *pieces: str | tuple[str, str]) -> None:
    for piece in pieces:
      if isinstance(piece, tuple):  # (slot name, text)
        name, piece = piece
        self.slots[name] = (piece, self.length)
      self.parts.append(piece)
      self.length += len(piece)

  @property
  def text(self) -> str:
    return "".join(self.parts).rstrip()


def _article(word: str) -> str:
  return "an" if word[0].lower() in "aeiou" else "a"


class _Names:
  """Draws unique, pronounceable full names."""

  def __init__(self, rng: random.Random):
    self.rng, self.used = rng, set()

  def _word(self, syllables: int) -> str:
    word = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
    return (word + self.rng.choice(_CODAS)).capitalize()

  def __call__(self) -> str:
    while True:
      name = f"{self._word(self.rng.randint(1, 2))} {self._word(self.rng.randint(2, 3))}"
      if name not in self.used:
        self.used.add(name)
        return name


def _entity(rng: random.Random, names: _Names) -> dict[str, Any]:
  birth = rng.randint(1780, 1960)
  cities = rng.sample(_CITIES, 3)
  years = sorted(rng.sample(range(birth + 18, birth + 75), 3))
  return {
      "name": names(), "pronoun": rng.choice(["He", "She"]), "birth_year": str(birth),
      "birth_city": cities[0], "youth_city": cities[1], "death_city": cities[2],
      "nationality": rng.choice(_NATIONALITIES), "occupation": rng.choice(_OCCUPATIONS),
      "sibling": names(), "sibling_year": str(birth + rng.choice([-4, -3, -2, 2, 3, 5])),
      "university": rng.choice(_UNIVERSITY_FORMS).format(rng.choice(_CITIES)),
      "mentor": names(), "work": f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}",
      "work_year": str(years[0]), "rival": names(),
      "rival_work": f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}",
      "rival_year": str(years[0] + rng.choice([-2, -1, 1, 3])), "award": rng.choice(_AWARDS),
      "award_year": str(years[1]), "colleague": names(), "colleague_award": rng.choice(_AWARDS),
      "spouse": names(), "death_year": str(years[2]),
  }


def _paragraphs(e: dict[str, Any], other: dict[str, Any], rng: random.Random) -> list[_Paragraph]:
  """Three paragraphs about entity `e`, with distractor facts about others."""
  his = "his" if e["pronoun"] == "He" else "her"
  early, career, later = _Paragraph(), _Paragraph(), _Paragraph()
  early.add(e["name"], " (", ("birth_year", e["birth_year"]), " – ", e["death_year"],
            ") was ", _article(e["nationality"]), " ", e["nationality"], " ",
            ("occupation", e["occupation"]), " born in ",
            ("birth_city", e["birth_city"]), ". ")
  early.add(e["pronoun"], " grew up in ", ("youth_city", e["youth_city"]), " together with ",
            his, " sibling ", ("sibling", e["sibling"]), ", who was born in ", e["sibling_year"],
            " in ", other["birth_city"], ". ")
  early.add(rng.choice([f"The family later moved to {other['youth_city']}, the home town of "
                        f"{other['name']}. ",
                        f"Their neighbour {other['name']}, born in {other['birth_year']}, "
                        f"became a well-known {other['occupation']}. "]))
  career.add(e["name"], " studied at the ", ("university", e["university"]), ", where ",
             e["pronoun"].lower(), " worked under the ", other["occupation"], " ",
             ("mentor", e["mentor"]), ". ")
  career.add("In ", ("work_year", e["work_year"]), ", ", e["name"].split()[0],
             " completed ", ("work", e["work"]), ", ", his, " best-known work. ")
  career.add(his.capitalize(), " rival ", e["rival"], " had published ", e["rival_work"], " in ",
             e["rival_year"], ", and the two were often compared by critics in ",
             other["birth_city"], ". ")
  later.add("In ", e["award_year"], " ", e["name"], " received the ", ("award", e["award"]),
            ", an honour also given to ", his, " colleague ", e["colleague"], ", who won the ",
            e["colleague_award"], " the same decade. ")
  later.add(e["pronoun"], " married ", ("spouse", e["spouse"]), " and spent ", his,
            " final years in ", ("death_city", e["death_city"]), ", where ", e["pronoun"].lower(),
            " died in ", ("death_year", e["death_year"]), ". ")
  return [early, career, later]


_QUESTIONS = {  # slot -> question templates (one is drawn per question)
    "birth_year": ["In what year was {name} born?", "When was {name} born?"],
    "birth_city": ["Where was {name} born?", "In which city was {name} born?"],
    "youth_city": ["Where did {name} grow up?", "In which city did {name} spend childhood?"],
    "occupation": ["What was the profession of {name}?", "What did {name} work as?"],
    "sibling": ["Who was the sibling of {name}?", "What was the name of {name}'s sibling?"],
    "university": ["Where did {name} study?", "Which institution did {name} attend?"],
    "mentor": ["Under whom did {name} work while studying?", "Who was the mentor of {name}?"],
    "work": ["What is the best-known work of {name}?", "Which work did {name} complete?"],
    "work_year": ["When did {name} complete {work}?", "In what year was {work} by {name} "
                  "completed?"],
    "award": ["Which honour did {name} receive?", "What award was given to {name}?"],
    "spouse": ["Who did {name} marry?", "Who was the spouse of {name}?"],
    "death_city": ["Where did {name} die?", "In which city did {name} spend final years?"],
    "death_year": ["When did {name} die?", "In what year did {name} die?"],
}


def _split(rng: random.Random, names: _Names, num_entities: int, questions_per_entity: int,
           split: str) -> dict[str, Any]:
  entities = [_entity(rng, names) for _ in range(num_entities)]
  data = []
  for i, e in enumerate(entities):
    other = entities[(i + 1 + rng.randrange(num_entities - 1)) % num_entities] \
        if num_entities > 1 else e
    paragraphs = []
    slots = rng.sample(sorted(_QUESTIONS), min(questions_per_entity, len(_QUESTIONS)))
    built = _paragraphs(e, other, rng)
    for p, paragraph in enumerate(built):
      qas = []
      for slot in slots:
        if slot not in paragraph.slots:
          continue
        answer, start = paragraph.slots[slot]
        question = rng.choice(_QUESTIONS[slot]).format(name=e["name"], work=e["work"])
        qas.append({"id": f"{split}-{i:04d}-{slot}", "question": question,
                    "answers": [{"text": answer, "answer_start": start}]})
      paragraphs.append({"context": paragraph.text, "qas": qas})
    data.append({"title": e["name"], "paragraphs": paragraphs})
  return {"version": "dpjax-synthetic-1", "data": data}


def generate(seed: int = 0, num_train_entities: int = 240, num_dev_entities: int = 60,
             questions_per_entity: int = 8) -> dict[str, dict[str, Any]]:
  """Generates the synthetic train and dev sets (SQuAD v1.1 format), deterministically.

  Returns:
    {"train": ..., "dev": ...}; every name in dev (entities and the people they mention) is
    absent from train.
  """
  if num_train_entities < 2 or num_dev_entities < 2:
    raise ValueError("need at least 2 entities per split")
  rng = random.Random(seed)
  names = _Names(rng)  # shared, so names are unique across both splits
  return {"train": _split(rng, names, num_train_entities, questions_per_entity, "train"),
          "dev": _split(rng, names, num_dev_entities, questions_per_entity, "dev")}


def write_synthetic(out_dir: str | os.PathLike, **kwargs) -> dict[str, pathlib.Path]:
  """Writes train.json, dev.json and corpus.json (all paragraphs) to `out_dir`.

  Files are written to a temporary name and renamed, so a killed run leaves no partial file (and
  processes of one multi-process job, which all write the same content, do not collide).
  """
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  splits = generate(**kwargs)
  corpus = {"version": "dpjax-synthetic-1",
            "data": [{"title": a["title"],
                      "paragraphs": [{"context": p["context"]} for p in a["paragraphs"]]}
                     for split in ("train", "dev") for a in splits[split]["data"]]}
  paths = {}
  for name, content in [("train", splits["train"]), ("dev", splits["dev"]), ("corpus", corpus)]:
    path = out_dir / f"{name}.json"
    text = json.dumps(content, ensure_ascii=False, indent=1)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
      write_text_atomic(path, text)  # unchanged files are not rewritten (read-only workdirs)
    paths[name] = path
  return paths


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description="Write the synthetic SQuAD-format data set.")
  parser.add_argument("--out", required=True)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--train-entities", type=int, default=240)
  parser.add_argument("--dev-entities", type=int, default=60)
  parser.add_argument("--questions-per-entity", type=int, default=8)
  args = parser.parse_args(argv)
  paths = write_synthetic(args.out, seed=args.seed, num_train_entities=args.train_entities,
                          num_dev_entities=args.dev_entities,
                          questions_per_entity=args.questions_per_entity)
  for name, path in paths.items():
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
