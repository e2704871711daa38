"""The cross-encoder reader over retrieved passages (`reading.read_retrieved`): its answer is the best
span over every window of a question's passages, as an exhaustive numpy search finds it."""
import dataclasses
import json
import re
import shutil

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dpjax.config import load_config
from dpjax.index.hybrid_weights import WEIGHTS
from dpjax.data.batches import cross_encoder_inputs
from dpjax.data.squad import Passage
from dpjax.data.windows import build_windows
from dpjax.errors import ConfigError
from dpjax.models.reader import create_reader
from dpjax.parallel import make_mesh
from dpjax import reading as rc
from dpjax.reading import read_retrieved
from dpjax.settings import Settings

import run
from conftest import load_script

# Short windows, a stride that overlaps them unevenly, spans of at most 3 tokens: long passages
# are cut into several windows and the best span must stay inside one of them.
DATA = ml_collections.ConfigDict({"max_seq_length": 23, "doc_stride": 7, "max_query_length": 11,
                                  "include_title": True})
MAX_ANSWER_LENGTH = 3
PASSAGES = [
    Passage("p0", "Rivers", "The Danube flows through ten countries before it reaches the Black "
            "Sea near the delta of Tulcea, which is a protected wetland of rare birds."),
    Passage("p1", "Short", "Oslo is the capital of Norway."),
    Passage("p2", "Volcanoes", "Mount Etna on Sicily is one of the most active volcanoes in the "
            "world; its eruptions have been recorded since 1500 BC and shaped Catania."),
    Passage("p3", "", "A passage without a title holds a few words about glaciers, fjords and "
            "the long winter nights of the far north, where the sun does not rise."),
    Passage("p4", "Chemistry", "Water boils at one hundred degrees Celsius at sea level."),
]
QUESTIONS = ["Where does the Danube end?", "What is the capital of Norway?",
             "Which volcano is on Sicily?", "What is a fjord?", "When does water boil?"]
# Best first, as a retriever ranks them: -1 is a retriever's padding, a repeated row counts once.
RETRIEVED = [[0, 2, 4], [1, 3, -1, 1], [2, 0, 3, 1, 4], [], [3]]


@pytest.fixture(scope="module")
def reader():
  return create_reader(Settings.of(load_config("experiments/demo.py:tiny")).model)


def reference(reader, tokenizer, question: str, rows: list[int]):
  """(score, text, passage row, rank, first token, last token) of the best span over the windows
  of `rows` by exhaustive search, each window read alone at full width; None if no passage."""
  q_ids, q_mask = tokenizer.encode([question], DATA.max_query_length)
  best, seen = None, set()
  for rank, row in enumerate(rows):
    if row < 0 or row in seen:
      continue
    seen.add(row)
    windows, _ = build_windows(tokenizer, [PASSAGES[row]], max_seq_length=DATA.max_seq_length,
                               doc_stride=DATA.doc_stride, include_title=DATA.include_title)
    for w in range(len(windows)):
      x = cross_encoder_inputs(windows.input_ids[w:w + 1], windows.attention_mask[w:w + 1],
                               q_ids, q_mask)
      logits = np.asarray(reader.window_logits(*(jnp.asarray(x[k]) for k in (
          "cross_input_ids", "cross_attention_mask", "cross_token_type_ids", "cross_align")))[0])
      context, first = windows.context_mask[w], int(np.argmax(windows.context_mask[w]))
      for i in np.flatnonzero(context & windows.is_max_context[w]):
        for j in range(i, min(i + MAX_ANSWER_LENGTH, len(context))):
          if not context[j]:
            continue
          score = float(logits[i, 0] + logits[j, 1])
          if best is None or score > best[0]:
            offset = int(windows.token_offset[w]) - first
            text = PASSAGES[row].text[windows.char_start[w, i]:windows.char_end[w, j]]
            best = (score, text, row, rank, i + offset, j + offset)
  return best


def test_the_answer_is_the_best_span_over_all_windows_of_the_retrieved_passages(reader,
                                                                                tokenizer):
  answers = read_retrieved(reader, tokenizer, DATA, QUESTIONS, PASSAGES, RETRIEVED,
                           mesh=make_mesh(), batch_size=8, max_answer_length=MAX_ANSWER_LENGTH)
  assert len(answers) == len(QUESTIONS)
  windows_used = 0
  for question, rows, got in zip(QUESTIONS, RETRIEVED, answers):
    want = reference(reader, tokenizer, question, rows)
    if want is None:
      assert got is None
      continue
    assert (got.text, got.passage_row, got.rank, got.token_start, got.token_end) == want[1:]
    np.testing.assert_allclose(got.score, want[0], rtol=1e-5, atol=1e-5)
    assert PASSAGES[got.passage_row].text[got.char_start:got.char_end] == got.text
    windows_used += 1
  assert windows_used == 4


def test_a_span_stays_inside_one_window_and_the_answer_length(reader, tokenizer):
  """Every answer lies in one window of its passage and covers at most max_answer_length
  tokens, whatever the reader's logits (several random readers)."""
  mesh = make_mesh()
  model = Settings.of(load_config("experiments/demo.py:tiny")).model
  for seed in range(3):
    answers = read_retrieved(create_reader(dataclasses.replace(model, seed=seed)), tokenizer,
                             DATA, QUESTIONS, PASSAGES, [[0, 1, 2, 3, 4]] * len(QUESTIONS),
                             mesh=mesh, batch_size=8,
                             max_answer_length=MAX_ANSWER_LENGTH)
    for answer in answers:
      assert 0 <= answer.token_end - answer.token_start < MAX_ANSWER_LENGTH
      windows, _ = build_windows(tokenizer, [PASSAGES[answer.passage_row]],
                                 max_seq_length=DATA.max_seq_length, doc_stride=DATA.doc_stride,
                                 include_title=DATA.include_title)
      starts = windows.token_offset
      ends = starts + windows.context_mask.sum(1)  # one past each window's last context token
      assert ((starts <= answer.token_start) & (answer.token_end < ends)).any()
      assert answer.rank == answer.passage_row  # the retrieved list is the passages in order


def test_questions_read_in_parts_answer_as_all_at_once(reader, tokenizer):
  mesh = make_mesh()
  whole = read_retrieved(reader, tokenizer, DATA, QUESTIONS, PASSAGES, RETRIEVED, mesh=mesh,
                         batch_size=8, max_answer_length=MAX_ANSWER_LENGTH)
  parts = read_retrieved(reader, tokenizer, DATA, QUESTIONS, PASSAGES, RETRIEVED, mesh=mesh,
                         batch_size=8, max_answer_length=MAX_ANSWER_LENGTH, questions_per_call=2)
  assert [(a.text, a.passage_row) if a else None for a in parts] == [
      (a.text, a.passage_row) if a else None for a in whole]
  assert read_retrieved(reader, tokenizer, DATA, ["Anything?"], PASSAGES, [[-1]], mesh=mesh,
                        batch_size=8) == [None]

  long = ml_collections.ConfigDict({**DATA.to_dict(), "max_seq_length": 500,
                                    "max_query_length": 14})  # 513 tokens, 512 positions
  with pytest.raises(ConfigError, match="up to 513 tokens.*512 positions"):
    read_retrieved(reader, tokenizer, long, QUESTIONS, PASSAGES, RETRIEVED, mesh=mesh,
                   batch_size=8)


@pytest.mark.parametrize("backwards", [False, True])
def test_equal_scores_go_to_the_better_ranked_passage(reader, tokenizer, monkeypatch,
                                                      backwards):
  """The same passage under two rows: the span scores the same in both, the first rank wins
  whatever order the reader's rows come in (here also one by one, last first)."""
  if backwards:
    original = rc.reader_logits

    def reader_logits(*args, **kwargs):
      rows = [(r, l) for part, logits in original(*args, **kwargs)
              for r, l in zip(part, logits)]
      for row, logits in rows[::-1]:
        yield np.array([row]), logits[None]
    monkeypatch.setattr(rc, "reader_logits", reader_logits)
  twins = PASSAGES + [PASSAGES[0]]
  for retrieved in ([[0, 5]], [[5, 0]]):
    (answer,) = rc.read_retrieved(reader, tokenizer, DATA, QUESTIONS[:1], twins, retrieved,
                                  mesh=make_mesh(), batch_size=8)
    assert (answer.rank, answer.passage_row) == (0, retrieved[0][0])


def test_each_passage_span_is_its_best_and_the_reader_alone_is_mu_1(reader, tokenizer):
  """`read_retrieved_passages` gives each retrieved passage's own best span (the exhaustive
  search over that passage alone); mixed with any retriever scores at mu = 1 it answers as
  `read_retrieved`, at mu = 0 with strictly decreasing scores as the first passage read."""
  mesh = make_mesh()
  per_passage = rc.read_retrieved_passages(reader, tokenizer, DATA, QUESTIONS, PASSAGES,
                                           RETRIEVED, mesh=mesh, batch_size=8,
                                           max_answer_length=MAX_ANSWER_LENGTH)
  assert [len(spans) for spans in per_passage] == [len(rows) for rows in RETRIEVED]
  for question, rows, spans in zip(QUESTIONS, RETRIEVED, per_passage):
    for rank, (row, got) in enumerate(zip(rows, spans)):
      if row < 0 or row in rows[:rank]:
        assert got is None
        continue
      want = reference(reader, tokenizer, question, [row])
      assert (got.text, got.passage_row, got.rank, got.token_start, got.token_end) == (
          want[1], want[2], rank, want[4], want[5])
      np.testing.assert_allclose(got.score, want[0], rtol=1e-5, atol=1e-5)
  alone = read_retrieved(reader, tokenizer, DATA, QUESTIONS, PASSAGES, RETRIEVED, mesh=mesh,
                         batch_size=8, max_answer_length=MAX_ANSWER_LENGTH)
  rng = np.random.default_rng(0)
  for _ in range(5):
    scores = [(100 * rng.normal(size=len(rows))).tolist() for rows in RETRIEVED]
    assert rc.mixed_answers(per_passage, scores, 1.0) == alone
    decreasing = [np.cumsum(-0.01 - rng.random(len(rows))).tolist() for rows in RETRIEVED]
    assert rc.mixed_answers(per_passage, decreasing, 0.0) == [
        next((a for a in spans if a is not None), None) for spans in per_passage]
  assert sum(a is not None and a.rank > 0 for a in alone) > 0  # mu = 0 and 1 do differ here


def span(rank: int, score: float) -> rc.ReadAnswer:
  return rc.ReadAnswer(f"span of rank {rank}", score, rank, rank, 0, 1, 0, 0)


def mixed_reference(per_passage, retriever_scores, mu):
  """A loop over the passages, best first: a later one wins only with a higher mixed score."""
  answers = []
  for spans, scores in zip(per_passage, retriever_scores):
    best = None
    for answer, retrieved in zip(spans, scores):
      if answer is not None:
        mixed = (1 - mu) * retrieved + mu * answer.score
        if best is None or mixed > best[0]:
          best = (mixed, answer)
    answers.append(best[1] if best else None)
  return answers


def test_mixed_answers_match_a_loop_over_the_passages():
  """Random passages read or not, small integer scores (so equal mixed scores happen, and go to
  the better rank), a question without passages, mu at the ends and between."""
  rng = np.random.default_rng(7)
  for _ in range(40):
    per_passage = [[None if rng.random() < 0.3 else span(r, float(rng.integers(-3, 4)))
                    for r in range(rng.integers(0, 7))] for _ in range(13)]
    scores = [rng.integers(0, 5, len(spans)).astype(float).tolist() for spans in per_passage]
    for mu in (0.0, 0.25, 0.5, 1.0, float(rng.random())):
      assert rc.mixed_answers(per_passage, scores, mu) == mixed_reference(per_passage, scores,
                                                                          mu), mu
  assert rc.mixed_answers([[], [None]], [[], [1.0]], 0.5) == [None, None]
  with pytest.raises(ValueError, match="not finite"):
    rc.mixed_answers([[span(0, 1.0)]], [[-np.inf]], 1.0)
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    rc.mixed_answers([[span(0, 1.0)]], [[1.0]], 1.5)


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
  """A workdir of the tiny pipeline: a phrase model, its dump and Flat index, and a reader."""
  workdir = tmp_path_factory.mktemp("pipeline")
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  for mode in ("train", "dump", "index", "teacher"):
    assert run.main([mode] + base) == 0, mode
  return workdir


@pytest.mark.slow
def test_reader_peer_benchmark_tiny(tiny_pipeline, tmp_path, monkeypatch):
  """`experiments/benchmarks/reader_peer.py` end to end on the tiny pipeline: a phrase model,
  its dump and Flat index, and a reader, all in one workdir."""
  shutil.copytree(tiny_pipeline, tmp_path, dirs_exist_ok=True)
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  out = tmp_path / "peer.json"
  script = load_script("experiments/benchmarks/reader_peer.py")
  peer = base + ["--reader", str(tmp_path), "--k", "3", "--warmup", "2", "--tune-questions",
                 "10"]
  assert script.main(peer + ["--out", str(out)]) == 0
  results = json.loads(out.read_text())
  assert list(results["systems"]) == ["dpjax", "dpjax+reader", "dpjax+reader (mixed)",
                                       "bm25+reader", "bm25+reader (mixed)"]
  assert results["k"] == 3 and results["questions"] == 12  # demo:tiny, 4 x 3 dev questions
  # mu is chosen on 10 of the 6 x 3 training questions, by EM@1 (ties to the smaller mu)
  assert results["tuning"]["questions"] == 10 and results["tuning"]["file"].endswith("train.json")
  for name in ("dpjax", "bm25"):
    alone, mixed = (results["systems"][f"{name}+reader{s}"] for s in ("", " (mixed)"))
    mixing = mixed["mixing"]
    assert [float(mu) for mu in mixing["em@1"]] == list(script.MU_GRID)
    assert mixing["mu"] in script.MU_GRID
    assert mixing["em@1"][str(mixing["mu"])] == max(mixing["em@1"].values())
    assert all(value < max(mixing["em@1"].values()) for mu, value in mixing["em@1"].items()
               if float(mu) < mixing["mu"])
    assert mixed["passages"] == alone["passages"]  # the same passages, the same reading
    assert mixed["questions_per_sec"] == alone["questions_per_sec"]
  for name, row in results["systems"].items():
    p = row["passages"]
    assert 0 <= p["top1"] <= p["top3"] <= 100 and 0 <= row["em@1"] <= 100, name
    assert len(row["hits"]["em@1"]) == 12
    assert abs(row["em@1"] - 100 * row["hits"]["em@1"].count("1") / 12) < 1e-9
    qps = row["questions_per_sec"]
    assert qps["pipeline"] <= min(qps.values())  # the pipeline is retrieval, then reading
  # Reading does not change what was retrieved: dpjax's passages are the same with and without.
  assert results["systems"]["dpjax"]["passages"] == results["systems"]["dpjax+reader"]["passages"]
  for name in ("dpjax+reader", "bm25+reader"):
    row = results["systems"][name]
    assert 0 <= row["read_from_first"] <= 100 and 0 <= row["read_passage_has_answer"] <= 100
  markdown = out.with_suffix(".md").read_text()
  assert "| bm25+reader |" in markdown and "| dpjax+reader (mixed) |" in markdown
  # BM25's rows first (from the corpus, no dump read), then dpjax's kept beside them: the same
  # answers as one run of both; a file of other settings is refused, not merged.
  # On a random sample of 7 questions (--sample), each question answered as in the full run.
  split = tmp_path / "split.json"
  assert script.main(peer + ["--sample", "7", "--systems", "bm25", "--out", str(split)]) == 0
  assert json.loads(split.read_text())["model_step"] is None
  assert script.main(peer + ["--sample", "7", "--systems", "dpjax", "--out", str(split)]) == 0
  both = json.loads(split.read_text())
  rows = both["question_rows"]
  assert len(rows) == 7 == both["questions"] and rows == sorted(set(rows)) and rows[-1] < 12
  assert set(both["systems"]) == set(results["systems"])
  assert [run["systems"] for run in both["runs"]] == [
      ["bm25+reader", "bm25+reader (mixed)"], ["dpjax", "dpjax+reader", "dpjax+reader (mixed)"]]
  assert ["--systems bm25" in run["command"] for run in both["runs"]] == [True, False]
  assert "--systems dpjax" in both["runs"][1]["command"]
  assert both["passages_sha256"] == results["passages_sha256"] and both["model_step"]
  for name, row in results["systems"].items():
    if "mixing" not in row:  # (mu is chosen again: the same training questions, the same mu)
      assert both["systems"][name]["hits"]["em@1"] == "".join(
          row["hits"]["em@1"][i] for i in rows), name
    else:
      assert both["systems"][name]["mixing"] == row["mixing"], name
  with pytest.raises(SystemExit, match="other k"):
    script.main(peer[:-6] + ["--k", "2", "--warmup", "2", "--tune-questions", "10", "--sample",
                             "7", "--systems", "bm25", "--out", str(split)])
  with pytest.raises(SystemExit, match="question_rows"):
    script.main(peer + ["--sample", "6", "--systems", "bm25", "--out", str(split)])
  # With mu = 1 the only choice, a mixed row answers as the reader alone, question by question.
  monkeypatch.setattr("dpjax.reading.MU_GRID", (1.0,))
  assert script.main(peer + ["--out", str(tmp_path / "mu1.json")]) == 0
  mu1 = json.loads((tmp_path / "mu1.json").read_text())["systems"]
  for name in ("dpjax", "bm25"):
    alone, mixed = (mu1[f"{name}+reader{s}"] for s in ("", " (mixed)"))
    assert mixed["mixing"]["mu"] == 1.0
    assert {k: mixed[k] for k in ("em@1", "f1@1", "hits", "read_from_first")} == {
        k: alone[k] for k in ("em@1", "f1@1", "hits", "read_from_first")}
  # The hybrid report on the same workdir, with these reader rows: every figure is its eval
  # file's or recomputed from per-question hits; BM25's row is the hybrid's BM25 index alone.
  hybrid = load_script("experiments/benchmarks/hybrid.py")
  report_path = tmp_path / "hybrid.json"
  assert hybrid.main(base + ["--set", "index.sparse_tune_questions=20", "--reader-json", str(out),
                             "--out", str(report_path)]) == 0
  report = json.loads(report_path.read_text())
  effect = report["merging_em@10"]  # EM@10 question by question: the counts add up
  assert effect["only_unmerged"] - effect["only_merged"] == round(
      (report["rows"]["dense, spans not merged"]["em@10"] - report["rows"]["dense"]["em@10"])
      * report["questions"] / 100)
  assert 0 <= effect["only_unmerged_by_an_overlapping_span"] <= effect["only_unmerged"]
  assert list(report["rows"]) == ["dense", "dense, spans not merged", "hybrid",
                                  "hybrid, passage BM25 only", "bm25", "dpjax+reader", "dpjax+reader (mixed)", "bm25+reader",
                                  "bm25+reader (mixed)"]
  assert report["rows"]["bm25+reader (mixed)"]["hits"] == results["systems"][
      "bm25+reader (mixed)"]["hits"]
  assert "em@1" in report["paired"]["dpjax+reader (mixed) vs hybrid"]
  # The passage-only row: passage BM25 at its best weight of the tuning record, sentence 0.
  passage_only, _, weights = hybrid.passage_only_run(tmp_path / "dump")
  tuning = json.loads((tmp_path / "dump" / "indexes" / "bm25" / "sparse_manifest.json"
                       ).read_text())["weight_tuning"]["scores"]
  best = max((tuning[f"{w:g},0"]["em@1"] + tuning[f"{w:g},0"]["top1"], -w) for w in WEIGHTS)
  assert weights == (-best[1], 0.0)
  assert report["rows"]["hybrid, passage BM25 only"]["hybrid"]["sentence_weight"] == 0.0
  evals = {"dense": "open_eval_Flat.json", "hybrid": "open_eval_Flat_hybrid.json",
           "hybrid, passage BM25 only": passage_only}
  for name, file in evals.items():
    written = json.loads((tmp_path / file).read_text())
    assert {k: report["rows"][name][k] for k in ("em@1", "top1", "top20")} == {
        k: written[k] for k in ("em@1", "top1", "top20")}
  bm25 = report["rows"]["bm25"]
  assert abs(bm25["top1"] - 100 * bm25["hits"]["top1"].count("1") / 12) < 1e-9
  a, b, p = report["paired"]["hybrid vs bm25"]["top1"]
  hits = (report["rows"]["hybrid"]["hits"]["top1"], bm25["hits"]["top1"])
  assert (a, b) == (sum(x > y for x, y in zip(*hits)), sum(x < y for x, y in zip(*hits)))
  assert report["rows"]["hybrid"]["hybrid"]["weight"] is not None
  # Reader rows of a sample (split.json, 7 questions): the other rows again on those questions,
  # and the paired test against the hybrid on them.
  assert hybrid.main(base + ["--reader-json", str(split), "--out", str(report_path), "--note",
                             "A note under the table."]) == 0
  sampled = json.loads(report_path.read_text())
  markdown = report_path.with_suffix(".md").read_text()
  assert markdown.endswith("\n\nA note under the table.\n") and "--note ..." in markdown
  rows = both["question_rows"]
  assert sampled["reader_sample"]["questions"] == 7 and sampled["questions"] == 12
  on_sample = sampled["reader_sample"]["rows"]["hybrid"]
  full = sampled["rows"]["hybrid"]["hits"]["em@1"]
  assert on_sample["hits"]["em@1"] == "".join(full[i] for i in rows)
  assert abs(on_sample["em@1"] - 100 * on_sample["hits"]["em@1"].count("1") / 7) < 1e-9
  a, b, p = sampled["paired"]["bm25+reader vs hybrid"]["em@1"]
  hits = (sampled["rows"]["bm25+reader"]["hits"]["em@1"], on_sample["hits"]["em@1"])
  assert (a, b) == (sum(x > y for x, y in zip(*hits)), sum(x < y for x, y in zip(*hits)))
  # The hybrid search's passages read (--set index.sparse=True): rows named hybrid, beside the
  # others; its phrase answers are the hybrid eval's on the same questions.
  assert script.main(peer + ["--sample", "7", "--systems", "dpjax", "--set", "index.sparse=True",
                             "--out", str(split)]) == 0
  third = json.loads(split.read_text())
  systems = third["systems"]
  assert set(systems) == set(both["systems"]) | {"hybrid", "hybrid+reader",
                                                 "hybrid+reader (mixed)"}
  assert systems["hybrid"]["hits"]["em@1"] == on_sample["hits"]["em@1"]
  weight = sampled["rows"]["hybrid"]["hybrid"]["weight"]
  assert all(systems[n]["hybrid"]["weight"] == weight for n in systems if n.startswith("hybrid"))
  assert hybrid.main(base + ["--reader-json", str(split), "--out", str(report_path)]) == 0
  assert "hybrid+reader (mixed) vs hybrid" in json.loads(report_path.read_text())["paired"]
  # Reader rows of other questions, searched with other weights or without a record of them
  # (rows made before the weights were recorded) are refused; so are weights set by hand.
  for key, value, says in (("questions_sha256", "0" * 64, "read other questions"),
                           ("weight", weight + 1.0, "searched with hybrid weight"),
                           ("sentence_weight", 7.0, "searched with hybrid weight"),
                           ("hybrid", None, r"searched with hybrid weights \(None, None\)")):
    other = json.loads(split.read_text())
    if key in ("weight", "sentence_weight"):
      other["systems"]["hybrid+reader"]["hybrid"][key] = value
    elif key == "hybrid":
      del other["systems"]["hybrid+reader (mixed)"]["hybrid"]
    else:
      other[key] = value
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=says):
      hybrid.main(base + ["--reader-json", str(tmp_path / "other.json"), "--out",
                          str(tmp_path / "refused.json")])
  with pytest.raises(SystemExit):
    hybrid.main(base + ["--set", "index.sparse_weight=1.0", "--out", str(report_path)])


def _trec_rows(path, row_of, k: int) -> list[list[int]]:
  """Each question's first k passage rows of a TREC run file, in its order of questions."""
  ranked: dict[str, list[int]] = {}
  for line in path.read_text().splitlines():
    qid, _, pid, _, _, _ = line.split()
    ranked.setdefault(qid, []).append(row_of[pid])
  return [rows[:k] for rows in ranked.values()]


@pytest.mark.slow
def test_eval_reader_reads_the_ranked_passages(tiny_pipeline, tmp_path, caplog, capsys):
  """`run.py eval --set eval.reader=...`: the reader reads each question's top passages of the
  eval's own ranking; with mu 1 it answers as `reading.read_retrieved` over them, with mu 0 from the
  first passage; mu unset is chosen on training questions; bad settings refused in one line."""
  from dpjax import reading
  from dpjax.data import Tokenizer
  from dpjax.index.dump import Dump
  shutil.copytree(tiny_pipeline, tmp_path, dirs_exist_ok=True)
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(tmp_path)]
  reader_sets = ["--set", f"eval.reader={tmp_path}", "--set", "eval.reader_passages=3"]
  config = load_config("experiments/demo.py:tiny")
  passages = Dump.read_passages(tmp_path / "dump")
  row_of = {p.id: row for row, p in enumerate(passages)}
  model, step = rc.restore_reader(Settings.of(config).model, tmp_path)
  for mu in (1.0, 0.0):
    assert run.main(["eval"] + base + reader_sets + ["--set", f"eval.reader_mu={mu}"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "open_eval_Flat.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "open_predictions_Flat.jsonl").open()]
    record, got = report["reader"], [line["reader_prediction"] for line in lines]
    assert (record["mu"], record["passages"], record["step"]) == (mu, 3, step)
    assert record["mu_tuning"] == {"set": "eval.reader_mu"}
    rows = _trec_rows(tmp_path / "open_run_Flat.trec", row_of, 3)
    texts = [line["question"] for line in lines]
    per_passage = rc.read_retrieved_passages(
        model, Tokenizer.from_pretrained(config.model.tokenizer), config.data, texts, passages,
        rows, mesh=make_mesh(), batch_size=config.eval.batch_size,
        max_answer_length=config.eval.max_answer_length)
    if mu == 1.0:  # the reader alone: its best span over the three passages
      expected = rc.read_retrieved(model, Tokenizer.from_pretrained(config.model.tokenizer),
                                   config.data, texts, passages, rows, mesh=make_mesh(),
                                   batch_size=config.eval.batch_size,
                                   max_answer_length=config.eval.max_answer_length)
      assert got == [a.text if a else None for a in expected]
    else:  # the retriever alone: the reader's best span in the first passage
      assert got == [spans[0].text if spans[0] else None for spans in per_passage]
    hits = record["hits"]["em@1"]
    assert len(hits) == report["questions"] == len(lines)
    assert hits == reading.em_hits(got, [line["answers"] for line in lines])
    assert abs(record["em@1"] - 100 * hits.count("1") / len(hits)) < 1e-9
    assert record["questions_per_sec"] > 0
    assert f"reader over the top 3 passages (mu {mu:g}): EM@1 {record['em@1']:.2f}" in printed
  # Unset, mu is chosen on 10 training questions by EM@1 (every mu's recorded).
  assert run.main(["eval"] + base + reader_sets + ["--set", "eval.reader_tune_questions=10"]) == 0
  record = json.loads((tmp_path / "open_eval_Flat.json").read_text())["reader"]
  tuning = record["mu_tuning"]
  assert tuning["questions"] == 10 and tuning["file"].endswith("train.json")
  assert [float(mu) for mu in tuning["em@1"]] == list(reading.MU_GRID)
  assert record["mu"] == tuning["mu"] and tuning["em@1"][str(record["mu"])] == max(
      tuning["em@1"].values())
  # Settings no run can use: one line (exit 2) before any work.
  (tmp_path / "untrained").mkdir()
  for bad, says in (("eval.reader_mu=1.5", r"eval.reader_mu 1.5: .* \[0, 1\]"),
                    (f"eval.reader={tmp_path}/untrained", "untrained: no reader checkpoint"),
                    ("eval.reader_passages=101", "eval.reader_passages 101 is more than "
                     "eval.passage_k 100"),
                    (f"eval.reader={tmp_path}/none", "none: no such workdir")):
    caplog.clear()
    assert run.main(["eval"] + base + reader_sets + ["--set", bad]) == 2, bad
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and re.search(says, errors[0]), (bad, errors)
