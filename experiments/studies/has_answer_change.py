"""What passage Top-k became when `metrics.has_answer` took DPR's definition (2026-11-27).

  python experiments/studies/has_answer_change.py --config experiments/squad.py:cpu-base \\
      --workdir W \\
      --set "index.corpus=['../shared/data/squad/dev-v1.1.json']" \\
      --set index.dump_name="'dump_windows_192_mc32'" --out results/has_answer.json

The evaluation questions (`index.questions`, default the dev split; `eval.limit`) are answered
once over the workdir's index (`index.dump_name`, `index.search_index`) as `run.py eval` answers
them, the top-100 passages of each kept, and the same ranked passages are scored twice:
- `dpr`: `dpjax.metrics.has_answer` (DPR's: NFD, `SimpleTokenizer` tokens, lower-cased, the
  answer's tokens contiguous in the passage's);
- `squad_normalised`: the definition dpjax used before (both texts SQuAD-normalised: lower-case,
  punctuation deleted, articles dropped, white space collapsed; the answer's normalised tokens
  contiguous in the passage's), frozen here.
Reported: Top-1/5/20/100, MRR@20 and P@20 by each, the questions whose Top-k hit differs (each
way) and a few of them with the answer and the words around it in the top passage.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

KS = (1, 5, 20, 100)
EXAMPLES = 8


def squad_normalised_has_answer(text: str, answers) -> bool:
  """dpjax's `has_answer` before 2026-11-27 (SQuAD-normalised token sequences)."""
  from dpjax.metrics import normalize_answer
  padded = f" {normalize_answer(text)} "
  return any(f" {normalize_answer(a)} " != "  " and f" {normalize_answer(a)} " in padded
             for a in answers)


def ranked_passages(args) -> tuple[list, list, dict]:
  """(questions, top-100 passage texts of each, facts of the run)."""
  from dpjax.config import load_config
  from dpjax.data.questions import read_questions
  from dpjax.index.evaluate import retrieve
  from dpjax.loading import data_paths
  from dpjax.main import open_searcher
  from dpjax.settings import Settings
  config = Settings.of(load_config(args.config, args.set))
  questions = read_questions(data_paths(config.data, config.index, args.workdir)["questions"])
  questions = questions[:config.eval.limit or None]
  searcher, step = open_searcher(config, args.workdir)
  index = searcher.index
  found = retrieve(index, *searcher.encode([q.question for q in questions]),
                   [(max(KS), "passage")], shared_hits=True,
                   max_answer_length=config.eval.max_answer_length)[0]
  texts = [[index.dump.passages[p.passage].text for p, _ in units] for units in found]
  return questions, texts, {"model_step": step, "dump": config.index.dump_name,
                            "index": config.index.search_index,
                            "index_tokens": index.manifest["num_tokens"]}


def score(hits: list[list[bool]]) -> dict:
  n = max(len(hits), 1)
  out = {f"top{k}": 100.0 * sum(any(h[:k]) for h in hits) / n for k in KS}
  out["mrr@20"] = 100.0 * sum(next((1 / (i + 1) for i, x in enumerate(h[:20]) if x), 0.0)
                              for h in hits) / n
  out["p@20"] = 100.0 * sum(sum(h[:20]) / 20 for h in hits) / n
  return out


def context(text: str, answers) -> str:
  """The words around the first answer found in `text` (case-insensitive), or its start."""
  low = text.lower()
  at = min((low.find(a.lower()) for a in answers if a and a.lower() in low), default=0)
  return text[max(at - 40, 0):at + 60].replace("\n", " ")


def study(args) -> dict:
  from dpjax.metrics import has_answer
  questions, texts, facts = ranked_passages(args)
  answers = [q.answers for q in questions]
  hits = {"dpr": [[has_answer(t, a) for t in ts] for ts, a in zip(texts, answers)],
          "squad_normalised": [[squad_normalised_has_answer(t, a) for t in ts]
                               for ts, a in zip(texts, answers)]}
  flips = {}
  for k in KS:
    new = [any(h[:k]) for h in hits["dpr"]]
    old = [any(h[:k]) for h in hits["squad_normalised"]]
    flips[f"top{k}"] = {"only_dpr": sum(a and not b for a, b in zip(new, old)),
                        "only_squad_normalised": sum(b and not a for a, b in zip(new, old))}
  examples = []
  for q, ts, new, old in zip(questions, texts, hits["dpr"], hits["squad_normalised"]):
    differ = next((i for i, (a, b) in enumerate(zip(new[:20], old[:20])) if a != b), None)
    if differ is not None and len(examples) < EXAMPLES:
      examples.append({"question": q.question, "answers": list(q.answers), "rank": differ + 1,
                       "dpr": new[differ], "passage_words": context(ts[differ], q.answers)})
  return {"config": args.config, "overrides": args.set, "workdir": str(args.workdir),
          **facts, "questions": len(questions),
          "scores": {name: score(h) for name, h in hits.items()}, "flips": flips,
          "examples": examples}


def markdown(results: dict, command: str) -> str:
  s = results["scores"]
  lines = ["# Passage Top-k: DPR's `has_answer` against the SQuAD-normalised match", "",
           f"Command: `{command}`", "",
           f"Model `{results['workdir']}` (step {results['model_step']}, {results['config']}); "
           f"dump `{results['dump']}`, index {results['index']} "
           f"({results['index_tokens']:,} tokens); {results['questions']:,} questions; the same "
           "ranked top-100 passages scored both ways.", "",
           "| match | " + " | ".join(f"Top-{k}" for k in KS) + " | MRR@20 | P@20 |",
           "|---|" + "---|" * (len(KS) + 2)]
  for name in ("squad_normalised", "dpr"):
    lines.append(f"| {name} | " + " | ".join(
        f"{s[name][key]:.2f}" for key in [*(f"top{k}" for k in KS), "mrr@20", "p@20"]) + " |")
  lines += ["", "Questions whose Top-k hit differs (only DPR's finds an answer / only the "
            "SQuAD-normalised match does): " + "; ".join(
                f"Top-{k} {f['only_dpr']} / {f['only_squad_normalised']}"
                for k, f in zip(KS, results["flips"].values())) + ".", "",
            "Examples (the first passage, within the top 20, that the two decide differently):",
            "", "| question | answers | rank | DPR's | passage words |", "|---|---|---|---|---|"]
  for e in results["examples"]:
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731
    lines.append(f"| {cell(e['question'])} | {cell(' / '.join(e['answers']))} | {e['rank']} | "
                 f"{'found' if e['dpr'] else 'not found'} | {cell(e['passage_words'])} |")
  from experiments.report import with_notes
  return with_notes(lines, results.get("notes", []))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True)
  parser.add_argument("--workdir", required=True, type=pathlib.Path)
  parser.add_argument("--out", required=True, help="results JSON (the .md goes beside it)")
  parser.add_argument("--note", action="append", default=[])
  parser.add_argument("--set", action="append", default=[])
  args = parser.parse_args(argv)
  from dpjax.config import setup_logging
  setup_logging(fmt="%(asctime)s %(message)s")
  from experiments.report import elide_notes, save_results
  results = study(args)
  results["notes"] = args.note
  argv = elide_notes(sys.argv[1:] if argv is None else argv)
  save_results(args.out, results, markdown, "experiments/studies/has_answer_change.py", argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
