"""SQuAD-format reading: bad input, windows, answer spans, and the real SQuAD files."""
import json
import os

import numpy as np
import pytest

from dpjax.data import squad
from dpjax.data.squad import build_features, read_squad
from dpjax.data.windows import build_windows
from dpjax.errors import DataError


def _write(tmp_path, content, name="data.json"):
  path = tmp_path / name
  if isinstance(content, (dict, list)):
    content = json.dumps(content)
  if isinstance(content, str):
    content = content.encode("utf-8")
  path.write_bytes(content)
  return path


def _squad(*paragraphs, title="T"):
  return {"data": [{"title": title, "paragraphs": list(paragraphs)}]}


def _qa(qid, question, text, start):
  return {"id": qid, "question": question, "answers": [{"text": text, "answer_start": start}]}


GOOD = {"context": "Paris is the capital of France.",
        "qas": [_qa("q1", "What is the capital of France?", "Paris", 0)]}


def test_truncated_json_names_file_and_position(tmp_path):
  text = json.dumps(_squad(GOOD))
  path = _write(tmp_path, text[:40])
  with pytest.raises(DataError, match=r"data\.json: invalid JSON at line 1 column \d+"):
    read_squad(path)


def test_empty_and_non_utf8_files(tmp_path):
  with pytest.raises(DataError, match="empty.json: file is empty"):
    read_squad(_write(tmp_path, "  \n", "empty.json"))
  latin1 = json.dumps(_squad(GOOD)).replace("Paris", "Par\u00eds").encode("latin-1")
  with pytest.raises(DataError, match=r"latin.json: not valid UTF-8 \(byte \d+"):
    read_squad(_write(tmp_path, latin1, "latin.json"))
  with pytest.raises(DataError, match="expected a JSON object with a 'data' list"):
    read_squad(_write(tmp_path, [1, 2], "list.json"))
  with pytest.raises(DataError, match="cannot read"):
    read_squad(tmp_path / "missing.json")


def test_bad_records_are_skipped_and_counted(tmp_path):
  data = _squad(
      GOOD,
      {"context": "Berlin is in Germany.",
       "qas": [{"id": "q2", "question": "Where is Berlin?"},  # no answers
               _qa("q3", "Where is Berlin?", "Austria", 13),  # not in context
               _qa("q4", "Where is Berlin?", "Germany", 0),  # wrong offset: relocated, kept
               {"question": "No id?", "answers": [{"text": "Berlin", "answer_start": 0}]}]},
      {"context": "   ", "qas": [_qa("q5", "?", "x", 0)]},  # empty context
      {"qas": []},  # no context
      # a negative answer_start slices from the end ("Italy" too): relocated, not kept as -6
      {"context": "Rome is in Italy.", "qas": [_qa("q6", "Where is Rome?", "Italy", -6)]})
  passages, questions, summary = read_squad(_write(tmp_path, data))
  assert [q.id for q in questions] == ["q1", "q4", "q6"]
  assert questions[1].answer_start == 13 and questions[2].answer_start == 11
  assert summary.answers_relocated == 2
  assert summary.questions_seen == 7
  assert summary.counts == {"question without 'answers'": 1, "answer not in context": 1,
                            "question without 'id' or 'question'": 1, "empty context": 1,
                            "question in a paragraph with empty context": 1,
                            "paragraph without 'context'": 1}
  assert "data[0].paragraphs[1].qas[1] (id=q3)" in str(summary)
  assert len(passages) == 3


def test_open_domain_questions_refuse_bad_answers_and_keep_unlocated_ones(tmp_path, caplog):
  """`read_questions`: answers must be a list of non-empty texts (a bare string was read letter
  by letter, an object without text gave an empty answer that matches an empty prediction);
  errors name the file and record. From a SQuAD file, a question whose answer is not in its
  paragraph is kept (open-domain needs the text, not the span); one without answers is
  skipped and logged."""
  from dpjax.data.questions import read_questions
  for answers, name in (("Paris", "string"), ([{"answer_start": 0}], "no_text"), ([1984], "int"),
                        ([None], "none"), (["Paris", " "], "blank")):
    rows = [{"id": "a", "question": "Capital?", "answers": ["Paris"]},
            {"id": "b", "question": "Capital?", "answers": answers}]
    path = _write(tmp_path, "\n".join(map(json.dumps, rows)), f"{name}.jsonl")
    with pytest.raises(DataError, match=rf"{name}\.jsonl:2: 'answers' must be a list"):
      read_questions(path)
    path = _write(tmp_path, {"data": rows}, f"{name}.json")
    with pytest.raises(DataError, match=rf"{name}\.json: record 1: 'answers' must be a list"):
      read_questions(path)
  with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8"):
    read_questions(_write(tmp_path, '{"question": "Par\u00eds?"}'.encode("latin-1"),
                          "latin.jsonl"))
  mixed = {"data": [{"question": "Capital?", "answers": ["Paris", {"text": "Paris, France"}]}]}
  assert read_questions(_write(tmp_path, mixed, "ok.json"))[0].answers == ["Paris",
                                                                            "Paris, France"]
  data = _squad({"context": "Berlin is in Germany.",
                 "qas": [_qa("q1", "Where is Berlin?", "Germany", 13),
                         _qa("q2", "Capital of Germany?", "Berlin, the capital", 0),
                         {"id": "q3", "question": "No answers?", "answers": []}]})
  with caplog.at_level("WARNING", logger="dpjax.data.questions"):
    questions = read_questions(_write(tmp_path, data, "squad.json"))
  assert [(q.id, q.answers, q.title) for q in questions] == [
      ("q1", ["Germany"], "T"), ("q2", ["Berlin, the capital"], "T")]
  assert "question without answer texts: 1 (e.g. question q3)" in caplog.text


def test_command_line_reports_errors_without_traceback(tmp_path, capsys):
  assert squad.main([str(_write(tmp_path, "{\"data\": [", "bad.json"))]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "bad.json" in err and "Traceback" not in err
  assert squad.main([str(_write(tmp_path, _squad(GOOD), "ok.json")), "--max-seq-length",
                     "64"]) == 0
  out = capsys.readouterr().out
  assert "questions read: 1, kept: 1, skipped: 0" in out


def test_json_that_python_refuses_beyond_syntax_is_a_data_error(tmp_path, capsys):
  """Nesting past the recursion limit (RecursionError) and an integer of more than 4,300 digits
  (ValueError) are bad records like any other: a DataError naming the file (SQuAD JSON and JSONL
  questions), a skipped and counted line in a JSONL corpus; they were tracebacks."""
  from dpjax.data.corpus import read_corpus
  from dpjax.data.questions import read_questions
  deep = "[" * 100_000 + "]" * 100_000
  huge = '{"id": "q", "question": "x?", "n": ' + "9" * 5000 + "}"
  for name, text, why in (("deep", deep, "nested too deeply"), ("huge", huge, "4300 digits")):
    with pytest.raises(DataError, match=f"{name}.json: invalid JSON: .*{why}"):
      read_squad(_write(tmp_path, text, f"{name}.json"))
    with pytest.raises(DataError, match=f"{name}.jsonl:2: invalid JSON: .*{why}"):
      read_questions(_write(tmp_path, '{"question": "a?", "answers": ["a"]}\n' + text,
                            f"{name}.jsonl"))
    summary = squad.SkipSummary()
    corpus = _write(tmp_path, '{"id": "p", "text": "a"}\n' + text, f"{name}_corpus.jsonl")
    assert [p.id for p in read_corpus([corpus], summary)] == ["p"]
    assert summary.counts == {"invalid JSON line": 1} and why in str(summary)
  assert squad.main([str(tmp_path / "deep.json")]) == 2
  assert "nested too deeply" in capsys.readouterr().err


def test_answer_start_as_integral_float_and_exact_later_answers_win(tmp_path):
  """An answer_start of 28.0 (pandas writes them) is the offset 28; a later answer at its own
  offset wins over relocating an earlier one by `find` (which took "cat" at 4, not 28); only
  when none is at its offset is the first found text kept, counted as relocated."""
  context = "The cat sat down. Later the cat left."
  def read(*answers):
    qa = {"id": "q", "question": "Who left?", "answers": list(answers)}
    _, questions, summary = read_squad(_write(tmp_path, _squad({"context": context,
                                                                "qas": [qa]})))
    return questions[0].answer_start, questions[0].answers, summary.answers_relocated
  assert read({"text": "cat", "answer_start": 28.0}) == (28, ["cat"], 0)
  assert read({"text": "cat", "answer_start": 99},
              {"text": "the cat", "answer_start": 24}) == (24, ["the cat", "cat"], 0)
  assert read({"text": "cat", "answer_start": 28.5}) == (4, ["cat"], 1)
  assert read({"text": "cat", "answer_start": True}) == (4, ["cat"], 1)
  assert read({"text": "left", "answer_start": 0},
              {"text": "cat", "answer_start": 1}) == (32, ["left", "cat"], 1)


def test_qas_that_is_not_a_list_is_counted(tmp_path):
  one = {"context": "Paris is the capital of France.", "qas": _qa("q2", "Capital?", "Paris", 0)}
  _, questions, summary = read_squad(_write(tmp_path, _squad(GOOD, one)))
  assert [q.id for q in questions] == ["q1"]  # q2 was dropped without a word
  assert summary.questions_seen == 2 and summary.counts == {"'qas' is not a list": 1}


def test_subset_matches_ids_as_read_and_skips_what_the_reader_skips(tmp_path):
  """`write_squad_subset` (a validation sample's questions file): numeric ids match their text
  (read_squad's ids), non-object records are left out, a lone surrogate in a kept answer is
  written escaped; all three were errors or tracebacks."""
  data = _squad({"context": "Berlin is in Germany.",
                 "qas": [_qa(7, "Where is Berlin?", "Germany", 13), "oops",
                         {"id": "s", "question": "Capital?",
                          "answers": [{"text": "Berlin", "answer_start": 0},
                                      {"text": "Berl\ud800n", "answer_start": 0}]}]},
                "not a paragraph")
  src = _write(tmp_path, data)
  assert squad.write_squad_subset(src, tmp_path / "sub.json", ["7", "s"]) == 2
  _, questions, _ = read_squad(tmp_path / "sub.json")
  assert [(q.id, q.answer_start) for q in questions] == [("7", 13), ("s", 0)]
  with pytest.raises(DataError, match=r"1 of 2 question ids not found \(e\.g\. '8'\)"):
    squad.write_squad_subset(src, tmp_path / "sub.json", ["7", "8"])


def test_titles_read_alike_by_every_reader(tmp_path):
  """A number as a title is its text, anything else but a string is '' in both the SQuAD reader
  and the corpus reader (validation matches gold passages by title and text: a dev file's own
  paragraphs were 'not in the corpus' built from it)."""
  from dpjax.data.corpus import read_corpus
  data = {"data": [{"title": title, "paragraphs": [{"context": f"Text {i}.", "qas": []}]}
                   for i, title in enumerate([1984, 0, True, None, "T", 2.5])]}
  path = _write(tmp_path, data)
  passages, _, _ = read_squad(path, require_answers=False)
  assert [p.title for p in passages] == ["1984", "0", "", "", "T", "2.5"]
  assert [p.title for p in read_corpus([path])] == [p.title for p in passages]


def test_command_line_refuses_impossible_lengths(tmp_path, capsys):
  path = str(_write(tmp_path, _squad(GOOD), "ok.json"))
  assert squad.main([path, "--doc-stride", "0"]) == 2
  assert capsys.readouterr().err.startswith("error: data.max_seq_length 384 leaves no room")
  with pytest.raises(SystemExit) as exit_:
    squad.main([path, "--max-query-length", "1"])
  assert exit_.value.code == 2 and "--max-query-length 1" in capsys.readouterr().err


@pytest.mark.parametrize("doc_stride, min_context", [(11, 0), (40, 0), (40, 3)])
def test_windows_cover_every_token_once(tokenizer, doc_stride, min_context):
  """Every context token in a window, kept in exactly one (its max-context window); a doc_stride
  past the window's room for context (26 tokens here) advances by the room (as HF's run_squad),
  not past tokens no window would hold."""
  context = " ".join(f"token{i}" for i in range(97))  # several word pieces each
  passages = [squad.Passage("p0", "A title", context), squad.Passage("p1", "", "short one")]
  windows, offsets = build_windows(tokenizer, passages, max_seq_length=31, doc_stride=doc_stride,
                                   min_context=min_context)
  n_tokens = len(offsets[0])
  first = windows.passage_index == 0
  assert first.sum() > 3
  seen = np.zeros(n_tokens, int)
  max_context = np.zeros(n_tokens, int)
  for w in np.flatnonzero(first):
    k = int(np.argmax(windows.context_mask[w]))
    count = int(windows.context_mask[w].sum())
    positions = windows.token_offset[w] + np.arange(count)
    seen[positions] += 1
    max_context[positions] += windows.is_max_context[w, k:k + count]
    np.testing.assert_array_equal(windows.char_start[w, k:k + count], offsets[0][positions, 0])
  assert (seen >= 1).all() and (max_context == 1).all()
  assert windows.input_ids.shape[1] == 31
  assert (windows.attention_mask.sum(1) <= 31).all()
  # An empty title adds no [SEP]: the context starts right after [CLS].
  last = np.flatnonzero(windows.passage_index == 1)[0]
  assert windows.context_mask[last, 1] and not windows.context_mask[last, 0]


@pytest.mark.parametrize("length", [5, 29, 30, 64, 97, 250])
def test_dump_windows_keep_min_context_with_fewer_windows(tokenizer, length):
  """min_context windows: every token once in its max-context window, with >= min_context
  tokens around it there (where the passage has them), and no more windows than doc_stride's."""
  context = " ".join(f"w{i}" for i in range(length))
  passages = [squad.Passage("p0", "", context)]
  n = len(build_windows(tokenizer, passages, max_seq_length=31, doc_stride=30)[1][0])
  wide, _ = build_windows(tokenizer, passages, max_seq_length=31, doc_stride=4, min_context=6)
  strided, _ = build_windows(tokenizer, passages, max_seq_length=31, doc_stride=4)
  assert len(wide.input_ids) <= len(strided.input_ids)
  if n > 60:
    assert len(wide.input_ids) < len(strided.input_ids)
  left, right = np.full(n, -1), np.full(n, -1)
  for w in range(len(wide.input_ids)):
    count = int(wide.context_mask[w].sum())
    positions = wide.token_offset[w] + np.arange(count)
    kept = wide.is_max_context[w, 1:1 + count]  # no title: the context starts after [CLS]
    assert (left[positions[kept]] == -1).all()  # each token kept once
    left[positions[kept]] = np.arange(count)[kept]
    right[positions[kept]] = count - 1 - np.arange(count)[kept]
  assert (left >= 0).all()
  t = np.arange(n)
  assert (left >= np.minimum(6, t)).all() and (right >= np.minimum(6, n - 1 - t)).all()


def test_answer_spans_and_cls_targets(tokenizer):
  context = " ".join(f"w{i}" for i in range(60)) + " the answer is Paris indeed"
  start = context.index("Paris")
  passages = [squad.Passage("p0", "Title", context)]
  questions = [squad.Question("q", "Where?", ["Paris"], start, 0)]
  features = build_features(tokenizer, passages, questions, max_seq_length=32, doc_stride=8,
                            max_query_length=8)
  windows = features.windows
  hits = features.start_position > 0
  assert hits.any() and (~hits).any()  # some windows miss the answer and target [CLS]
  assert (features.end_position[~hits] == 0).all()
  for f in np.flatnonzero(hits):
    w, s, e = features.window_index[f], features.start_position[f], features.end_position[f]
    assert context[windows.char_start[w, s]:windows.char_end[w, e]] == "Paris"
  assert features.question_input_ids.shape == (1, 8)


def _span_texts(features, passages, questions):
  windows = features.windows
  for f in np.flatnonzero(features.start_position > 0):
    w, s, e = features.window_index[f], features.start_position[f], features.end_position[f]
    question = questions[features.question_index[f]]
    context = passages[question.passage_index].context
    yield context[windows.char_start[w, s]:windows.char_end[w, e]], question.answers[0]


def test_real_squad_dev(squad_dir, tokenizer):
  passages, questions, summary = read_squad(squad_dir / "dev-v1.1.json")
  assert summary.questions_seen == len(questions) == 10570
  assert len(passages) == 2067
  features = build_features(tokenizer, passages, questions, max_seq_length=192, doc_stride=64)
  pairs = list(_span_texts(features, passages, questions))
  exact = sum(" ".join(a.split()) == " ".join(b.split()) for a, b in pairs)
  assert len(pairs) > 10570  # long passages give several answerable windows
  assert exact / len(pairs) >= 0.99


@pytest.mark.slow
def test_real_squad_train(squad_dir, tokenizer):
  passages, questions, summary = read_squad(squad_dir / "train-v1.1.json")
  assert summary.questions_seen == 87599
  assert (summary.questions_seen - len(questions)) / summary.questions_seen <= 0.005
  assert len(passages) == 18896
  features = build_features(tokenizer, passages, questions, max_seq_length=384, doc_stride=128)
  pairs = list(_span_texts(features, passages, questions))
  exact = sum(" ".join(a.split()) == " ".join(b.split()) for a, b in pairs)
  assert exact / len(pairs) >= 0.99


def test_questions_jsonl_errors_name_the_file_line(tmp_path):
  """JSONL questions: errors give the file's line (blank lines counted), duplicates too; a line
  holding U+2028 inside a string is one line; a byte-order mark, `.ndjson` and extension-less
  JSONL are read; a lone surrogate, a blank question and a file without questions are errors."""
  from dpjax.data.questions import read_questions
  good = json.dumps({"id": "a", "question": "Q?", "answers": ["x"]})
  with pytest.raises(DataError, match=r"lines\.jsonl:4 needs a non-empty 'question'"):
    read_questions(_write(tmp_path, f"\n\n{good}\n{{\"id\": \"b\"}}\n", "lines.jsonl"))
  with pytest.raises(DataError, match=r"dup\.jsonl:4: duplicate question id 'a'"):
    read_questions(_write(tmp_path, f"\n\n{good}\n{good}\n", "dup.jsonl"))
  raw = json.dumps({"id": "a", "question": "who\u2028is", "answers": ["x"]}, ensure_ascii=False)
  assert read_questions(_write(tmp_path, raw + "\n", "sep.jsonl"))[0].question == "who\u2028is"
  bom = _write(tmp_path, ("\ufeff" + good + "\r\n").encode(), "bom.jsonl")
  assert len(read_questions(bom)) == 1
  for name in ("q.ndjson", "questions"):
    assert read_questions(_write(tmp_path, good + "\n", name))[0].id == "a"
  with pytest.raises(DataError, match=r"lines\.json: invalid JSON at line 2.*Extra data.*\.jsonl"):
    read_questions(_write(tmp_path, f"{good}\n{good}\n", "lines.json"))
  with pytest.raises(DataError, match=r"surrogate\.jsonl:1: invalid Unicode"):
    read_questions(_write(tmp_path, '{"id": "a", "question": "who\\ud800", "answers": ["x"]}',
                          "surrogate.jsonl"))
  with pytest.raises(DataError, match=r"blank\.jsonl:1 needs a non-empty 'question'"):
    read_questions(_write(tmp_path, '{"id": "a", "question": " ", "answers": ["x"]}',
                          "blank.jsonl"))
  for content, name in (("", "empty.jsonl"), ({"data": []}, "empty.json")):
    with pytest.raises(DataError, match=rf"{name}: no questions"):
      read_questions(_write(tmp_path, content, name))


def test_corpus_ids_bom_and_command_line(tmp_path, capsys):
  """Corpus files: a byte-order mark keeps the first record; generated ids of files with one
  stem in two folders do not collide (nor are passages dropped); a generated id equal to
  another passage's is an error; empty ids are generated, non-scalar ones skipped and counted;
  the command line prints the skip summary and creates --out's folder."""
  from dpjax.data import corpus
  from dpjax.data.squad import SkipSummary
  bom = _write(tmp_path, '\ufeff{"id": "p1", "text": "first"}\n{"id": "p2", "text": "second"}\n'
               .encode(), "bom.jsonl")
  assert [p.id for p in corpus.read_corpus(bom)] == ["p1", "p2"]
  for folder, texts in (("x", ["alpha", "beta"]), ("y", ["gamma", "delta"])):
    (tmp_path / folder).mkdir()
    _write(tmp_path / folder, "".join(json.dumps({"text": t}) + "\n" for t in texts), "part.jsonl")
  both = [tmp_path / "x" / "part.jsonl", tmp_path / "y" / "part.jsonl"]
  assert [p.id for p in corpus.read_corpus(both)] == ["x/part-1", "x/part-2", "y/part-1",
                                                       "y/part-2"]
  with pytest.raises(DataError, match="given more than once"):
    list(corpus.read_corpus([both[0], both[0]]))
  clash = _write(tmp_path, '{"id": "clash-2", "text": "a"}\n{"text": "b"}\n', "clash.jsonl")
  with pytest.raises(DataError, match=r"clash\.jsonl:2: id 'clash-2' is both a record's own"):
    list(corpus.read_corpus(clash))
  clash = _write(tmp_path, '{"text": "a"}\n{"id": "clash-1", "text": "b"}\n', "clash.jsonl")
  with pytest.raises(DataError, match=r"clash\.jsonl:2: id 'clash-1' is both a record's own"):
    list(corpus.read_corpus(clash))
  odd = _write(tmp_path, '{"id": "", "text": "a"}\n{"id": {"k": 1}, "text": "b"}\n'
               '{"id": 7, "title": ["t"], "text": "c"}\n', "odd.jsonl")
  summary = SkipSummary()
  assert [(p.id, p.title) for p in corpus.read_corpus(odd, summary)] == [("odd-1", ""),
                                                                        ("7", "")]
  assert summary.counts == {"id is neither a string nor a number": 1}
  out = tmp_path / "new" / "dir" / "out.jsonl"
  assert corpus.main(["squad", str(odd), "--out", str(out)]) == 0
  captured = capsys.readouterr()
  assert "id is neither a string nor a number: 1" in captured.err
  assert "wrote 2 passages" in captured.out and out.is_file()


def test_questions_null_ids_clash_messages_and_leading_blank_lines(tmp_path):
  """Questions: a null or empty id is a missing one (the record number), not the id 'None'; a
  duplicate of a record number and a given id says which line has no id; an extension-less
  JSONL file opening with blank lines is JSONL (it was read as JSON: 'Extra data')."""
  from dpjax.data.questions import read_questions
  rows = [{"id": None, "question": "Q?", "answers": ["x"]},
          {"id": None, "question": "R?", "answers": ["y"]},
          {"id": "", "question": "S?", "answers": ["z"]}]
  for name in ("null.jsonl", "null.json"):
    content = "".join(json.dumps(r) + "\n" for r in rows) if name.endswith("l") else {"data": rows}
    assert [q.id for q in read_questions(_write(tmp_path, content, name))] == ["0", "1", "2"]
  given = json.dumps({"id": "1", "question": "Q?", "answers": ["x"]})
  nameless = json.dumps({"question": "R?", "answers": ["y"]})
  with pytest.raises(DataError, match=r"qmix\.jsonl:2: duplicate question id '1': this record "
                     r"has no 'id' .*record number, which \S*qmix\.jsonl:1 has as its 'id'"):
    read_questions(_write(tmp_path, f"{given}\n{nameless}\n", "qmix.jsonl"))
  given = json.dumps({"id": "0", "question": "Q?", "answers": ["x"]})
  with pytest.raises(DataError, match=r"qrev\.jsonl:2: duplicate question id '0': \S*qrev\.jsonl:1 "
                     r"has no 'id' .*record number, which this record has as its 'id'"):
    read_questions(_write(tmp_path, f"{nameless}\n{given}\n", "qrev.jsonl"))
  with pytest.raises(DataError, match=r"qdup\.jsonl:2: duplicate question id '0' \(also at "
                     r"\S*qdup\.jsonl:1\)"):
    read_questions(_write(tmp_path, f"{given}\n{given}\n", "qdup.jsonl"))
  blank = _write(tmp_path, f"\n  \n{given}\n{nameless}\n", "questions")
  assert [q.id for q in read_questions(blank)] == ["0", "1"]
  from dpjax.data import corpus
  passages = _write(tmp_path, '\ufeff\n\n{"text": "a"}\n{"text": "b"}\n'.encode(), "passages")
  assert corpus.is_jsonl(passages) and corpus.is_jsonl(blank)
  assert [p.id for p in corpus.read_corpus(passages)] == ["passages-3", "passages-4"]
  assert not corpus.is_jsonl(_write(tmp_path, '\n\n{"data": []}\n', "squadlike"))


def test_corpus_same_stem_in_one_folder_and_generated_id_clash(tmp_path):
  """Generated ids of 'c/part.jsonl' and 'c/part.ndjson' keep the suffix (both were 'part-1':
  an error calling one of them a record's own id); two generated ids that still collide
  ('x-1.jsonl' line 1 and 'x.json' data[1].paragraphs[1]) are an error saying so."""
  from dpjax.data import corpus
  (tmp_path / "c").mkdir()
  parts = [_write(tmp_path / "c", json.dumps({"text": t}) + "\n", name)
           for t, name in (("alpha", "part.jsonl"), ("beta", "part.ndjson"), ("gamma", "part"))]
  assert [p.id for p in corpus.read_corpus(parts)] == ["part.jsonl-1", "part.ndjson-1", "part-1"]
  (tmp_path / "d").mkdir()
  parts.append(_write(tmp_path / "d", json.dumps({"text": "delta"}) + "\n", "part.jsonl"))
  assert [p.id for p in corpus.read_corpus(parts)] == [
      "c/part.jsonl-1", "c/part.ndjson-1", "c/part-1", "d/part-1"]
  squad_file = _write(tmp_path, {"data": [{"paragraphs": [{"context": "a"}]},
                                          {"paragraphs": [{"context": "b"}, {"context": "c"}]}]},
                      "x.json")
  lines = _write(tmp_path, json.dumps({"text": "d"}) + "\n", "x-1.jsonl")
  with pytest.raises(DataError, match=r"x-1\.jsonl:1: id 'x-1-1' made for this record without an "
                     r"id was also made for a record without an id in .*x\.json: give every"):
    list(corpus.read_corpus([squad_file, lines]))


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux /proc/self/mem")
def test_corpus_command_line_names_the_file_it_cannot_read(tmp_path, capsys):
  """The corpus command line: an input file that fails to read (/proc/self/mem: an I/O error on
  reading) is named as such; it was reported as '<out>: cannot write'. A write error still names
  --out (and the path that failed)."""
  from dpjax.data import corpus
  out = tmp_path / "out" / "o.jsonl"
  link = tmp_path / "mem.jsonl"
  link.symlink_to("/proc/self/mem")
  for source in ("/proc/self/mem", str(link)):
    assert corpus.main(["squad", source, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source}: cannot read: ") and str(out) not in err
  good = _write(tmp_path, json.dumps({"id": "p", "text": "a"}) + "\n", "good.jsonl")
  blocker = _write(tmp_path, "", "file")
  out = blocker / "o.jsonl"
  assert corpus.main(["squad", str(good), "--out", str(out)]) == 2
  assert capsys.readouterr().err.startswith(f"error: {out}: cannot write ({blocker}): ")


def test_corpus_repeats_are_counted_by_digest_and_a_corpus_reads_again(tmp_path):
  """Repeated passages (same title and text) and duplicate ids are skipped and counted as
  before, though only 16-byte digests of them are kept; a second read of the corpus gives the
  same passages and counts nothing again; the digest table keeps every member as it grows."""
  from dpjax.data import corpus
  from dpjax.data.squad import SkipSummary
  rows = [{"id": "a", "title": "T", "text": "one"}, {"id": "b", "title": "T", "text": "one"},
          {"id": "c", "title": "U", "text": "one"}, {"id": "a", "title": "V", "text": "two"},
          {"title": "T", "text": "three"}, {"id": "d", "title": "T\u00e9", "text": "one"}]
  path = _write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows), "rep.jsonl")
  summary = SkipSummary()
  passages = corpus.read_corpus(path, summary)
  first = [(p.id, p.title, p.text) for p in passages]
  assert first == [("a", "T", "one"), ("c", "U", "one"), ("rep-5", "T", "three"),
                   ("d", "T\u00e9", "one")]
  assert summary.counts == {"repeated passage (same title and text)": 1,
                            "duplicate passage id": 1}
  assert [(p.id, p.title, p.text) for p in passages] == first
  assert summary.counts == {"repeated passage (same title and text)": 1,
                            "duplicate passage id": 1}
  # the parts of a digest cannot run into each other
  assert corpus.digest("ab", "c") != corpus.digest("a", "bc")
  table = corpus.DigestTable(value_bytes=4, slots=8)
  keys = [corpus.digest(str(i)) for i in range(5003)]
  for i, key in enumerate(keys):
    at, value = table.find(key)
    assert value is None
    table.insert(at, key, i % 7)
  assert len(table) == 5003 and table.slots * 3 >= 5003 * 4
  assert [table.find(key)[1] for key in keys] == [i % 7 for i in range(5003)]
  assert table.find(corpus.digest("absent"))[1] is None
