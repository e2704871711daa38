"""The validation experiment script and its notebook, end to end on a tiny run."""
import json

import numpy as np
import pytest

from conftest import REPO, load_script

import run

experiment = load_script("experiments/studies/validation_experiment.py")


def test_kendall_tau():
  assert experiment.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert experiment.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # tau-b with a tie: 3 concordant, 2 discordant pairs, 1 tied in b -> 1 / sqrt(5 * 6).
  assert experiment.kendall_tau([1, 2, 3, 4], [1, 3, 2, 2]) == pytest.approx(1 / np.sqrt(30))
  assert np.isnan(experiment.kendall_tau([1, 1, 1], [1, 2, 3]))  # no ranking to compare


def test_mcnemar_and_equal_size_pairs():
  assert experiment.mcnemar_p("1100", "1010") == (1, 1, 1.0)
  assert experiment.mcnemar_p("1111", "0000") == (4, 0, pytest.approx(0.125))  # 2 x 1/16
  assert experiment.mcnemar_p("10", "10") == (0, 0, 1.0)
  tokens = {"C0": 10, "R0.1": 30, "R0.333": 100, "H1": 28, "H2": 35, "H32": 90, "full": 300}
  assert experiment.equal_size_pairs(tokens) == [("R0.1", "H1"), ("R0.333", "H32")]
  kinds = ["H16", "full", "R0.333", "H2", "C0", "R0.1", "H1"]
  assert sorted(kinds, key=experiment.subcorpus_order) == \
      ["C0", "R0.1", "R0.333", "H1", "H2", "H16", "full"]


def test_equal_size_table_verdicts():
  tokens = {"R0.1": 30, "H1": 28, "R0.333": 100, "H32": 90}
  tau = {"R0.1": {"em@1": 0.5, "top20": 1.0}, "H1": {"em@1": 1.0, "top20": 1.0},
         "R0.333": {"em@1": 1.0, "top20": 1.0}, "H32": {"em@1": 1.0, "top20": 1.0}}
  rows = experiment.equal_size_table(tau, tokens)[2:]
  assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["H1", "tie"]
  one_model = {k: {"em@1": float("nan"), "top20": float("nan")} for k in tokens}
  rows = experiment.equal_size_table(one_model, tokens)[2:]
  assert all("n/a" in row.rsplit("|", 2)[1] for row in rows)


def test_findings_without_hard_subcorpora():
  """Subcorpora without H_k (a model comparison): no empty hard-vs-random table, the paired
  comparison on the full corpus is still reported."""
  def model(em, hits):
    full = {"em@1": em, "top20": 90.0, "tokens": 300, "hits": {"em@1": hits, "top20": "11"}}
    return {"subcorpora": {"C0": {"em@1": em, "top20": 95.0, "tokens": 10}, "full": full}}
  results = {"models": {"a": model(50.0, "10"), "b": model(0.0, "00")}, "tau": {},
             "hard_builder": None, "compare": [("a", "b")]}
  lines = experiment.findings(results)
  assert not any("Hard vs random" in line or line.startswith("| random") for line in lines)
  assert lines[-1].startswith("| a vs b | 50.00 | 0.00 | +50.00 | 1 / 0 | 1 |")


def test_findings_of_a_builder_without_a_random_subcorpus():
  """H32 built by one of the models and no R_r: the comparison without the builder points to
  the tau table's columns instead of ending the sentence with nothing."""
  def model(em):
    return {"subcorpora": {k: {"em@1": em, "top20": 90.0, "tokens": n, "hits": {}}
                           for k, n in (("C0", 10), ("H32", 90), ("full", 300))}}
  tau = {k: {"em@1": 1.0, "top20": 1.0} for k in ("C0", "H32", "full")}
  results = {"models": {"b": model(20.0), "x": model(30.0), "y": model(25.0), "z": model(10.0)},
             "tau": tau, "hard_builder": "b", "tau_without_builder": tau}
  lines = experiment.findings(results)
  said = lines.index(next(line for line in lines if line.endswith("The same comparison "
                                                                    "without it:")))
  assert lines[said + 2] == ("(no random and hard subcorpus of about equal size: the tau "
                             "table's \"without b\" columns)")
  results["tau_without_builder"] = None
  assert "(fewer than 3 other models" in experiment.findings(results)[said + 2]


def test_reference_models_only_from_the_same_questions(tmp_path):
  """A model of an earlier report joins the paired comparisons only when that report sampled the
  same dev questions (count and C0); its full-corpus hits are compared as a model's."""
  c0 = {"kind": "C0", "corpus": ["train.json", "dev.json"], "sample_questions": 2, "seed": 0,
        "passages": 2}
  full = {"em@1": 0.0, "top20": 50.0, "hits": {"em@1": "00", "top20": "01"}}
  report = tmp_path / "old.json"
  report.write_text(json.dumps({"questions": 2, "subcorpora": {"C0": c0},
                                "models": {"old": {"subcorpora": {"full": full}}}}))
  subcorpora = {"C0": {"meta": dict(c0)}}
  found = experiment.load_references([f"{report}:old"], subcorpora, 2)
  assert found["old"]["subcorpora"]["full"] == full and found["old"]["reference"] == str(report)
  for bad_meta, count in (({**c0, "seed": 1}, 2), ({**c0, "passages": 3}, 2), (c0, 3)):
    with pytest.raises(SystemExit, match="other dev questions"):
      experiment.load_references([f"{report}:old"], {"C0": {"meta": bad_meta}}, count)
  with pytest.raises(SystemExit, match="no model 'nope'"):
    experiment.load_references([f"{report}:nope"], subcorpora, 2)
  new = {"subcorpora": {"full": {"em@1": 50.0, "top20": 50.0, "tokens": 300,
                                 "hits": {"em@1": "10", "top20": "01"}}}}
  lines = experiment.findings({"models": {"new": new}, "references": found, "tau": {},
                               "hard_builder": None, "compare": [("new", "old")]})
  assert "old from an earlier report" in " ".join(lines)
  assert lines[-1].startswith("| new vs old | 50.00 | 0.00 | +50.00 | 1 / 0 | 1 |")


def test_hard_builder():
  subcorpora = {"C0": {"meta": {"kind": "C0"}}, "R0.1": {"meta": {"fingerprint": "a"}},
                "H1": {"meta": {"fingerprint": "b"}}, "H2": {"meta": {"fingerprint": "b"}}}
  assert experiment.hard_builder(subcorpora, {"x": "a", "y": "b"}) == "y"
  assert experiment.hard_builder(subcorpora, {"x": "a", "z": "c"}) is None



def test_model_dump_dir_by_step_and_dtype(tmp_path):
  """The workdir's own dump serves its step in its dtype (float32 when it does not say); any
  other step or dtype gets a folder of its own."""
  (tmp_path / "dump").mkdir()
  manifest = {"complete": True, "model": {"step": 7}, "settings": {"min_context": 0}}
  (tmp_path / "dump" / "manifest.json").write_text(json.dumps(manifest))
  assert experiment.model_dump_dir(tmp_path, 7) == tmp_path / "dump"
  assert experiment.model_dump_dir(tmp_path, 8) == tmp_path / "dump_step8"
  assert experiment.model_dump_dir(tmp_path, 7, "bfloat16") == tmp_path / "dump_step7_bfloat16"
  manifest["settings"]["compute_dtype"] = "bfloat16"
  (tmp_path / "dump" / "manifest.json").write_text(json.dumps(manifest))
  assert experiment.model_dump_dir(tmp_path, 7, "bfloat16") == tmp_path / "dump"
  assert experiment.model_dump_dir(tmp_path, 7) == tmp_path / "dump_step7"

@pytest.mark.slow
def test_experiment_and_notebook(tmp_path, monkeypatch):
  workdir = tmp_path / "model"
  base = ["--config", "experiments/demo.py:tiny", "--workdir", str(workdir)]
  for mode in ("train", "dump", "index"):
    assert run.main([mode] + base) == 0
  assert run.main(["subcorpus"] + base + ["--set", "validation.kinds=['C0','R0.5','H1','H4']"]) == 0
  out = tmp_path / "results" / "validation.json"
  monkeypatch.chdir(REPO)
  assert experiment.main(["--config", "experiments/demo.py:tiny",
                          "--subcorpora", str(workdir / "subcorpora"),
                          "--model", f"early={workdir}@3", "--model", f"final={workdir}@6",
                          "--compare", "final:early", "--out", str(out)]) == 0
  results = json.loads(out.read_text())
  assert list(results["models"]) == ["early", "final"]
  final = results["models"]["final"]["subcorpora"]
  assert list(final) == ["C0", "R0.5", "H1", "H4", "full"]
  assert final["C0"]["tokens"] <= final["H1"]["tokens"] <= final["H4"]["tokens"] < \
      final["full"]["tokens"]
  assert results["tau"]["full"]["em@1"] in (1.0,) or np.isnan(results["tau"]["full"]["em@1"])
  # `run.py subcorpus` built H_k with the latest model (step 6): its top phrase over the full
  # corpus is in every H_k, so its EM@1 there is its full-corpus EM@1, and it is named.
  assert results["hard_builder"] == "final" and results["tau_without_builder"] is None
  for kind in ("H1", "H4"):
    assert final[kind]["em@1"] == pytest.approx(final["full"]["em@1"])
  report_md = out.with_suffix(".md").read_text()
  assert "built from final's own retrieval" in report_md
  assert "Kendall tau" in report_md and "| final vs early |" in report_md
  assert "| R0.5 |" in report_md.split("## Findings")[1]  # R0.5 next to its nearest H_k
  hits = final["full"]["hits"]  # per question, for the paired test
  assert len(hits["em@1"]) == len(hits["top20"]) == results["questions"]
  assert 100 * hits["em@1"].count("1") / len(hits["em@1"]) == pytest.approx(final["full"]["em@1"])
  top20 = 100 * hits["top20"].count("1") / len(hits["top20"])
  assert top20 == pytest.approx(final["full"]["top20"])
  # The full-corpus row of the subset evaluation equals the run.py eval numbers of step 6.
  assert run.main(["eval"] + base) == 0
  report = json.loads((workdir / "open_eval_Flat.json").read_text())
  assert final["full"]["em@1"] == pytest.approx(report["em@1"])
  assert final["full"]["top20"] == pytest.approx(report["top20"])

  # A rerun takes every model's figures from its cache (<workdir>/validation_step<N>.json) while
  # the subcorpora, questions and settings are the same, and recomputes them when they change.
  cache = workdir / "validation_step3.json"
  cached = json.loads(cache.read_text())
  cached["result"]["rc_em"] = 123.0
  cache.write_text(json.dumps(cached))
  rerun = tmp_path / "results" / "rerun.json"
  args = ["--config", "experiments/demo.py:tiny", "--subcorpora", str(workdir / "subcorpora"),
          "--model", f"early={workdir}@3", "--model", f"final={workdir}@6"]
  assert experiment.main(args + ["--out", str(rerun)]) == 0
  assert json.loads(rerun.read_text())["models"]["early"]["rc_em"] == 123.0
  assert experiment.main(args + ["--out", str(rerun), "--set", "eval.max_answer_length=5"]) == 0
  assert json.loads(rerun.read_text())["models"]["early"]["rc_em"] != 123.0
  # ... and when the checkpoint holds other parameters (a retrained workdir).
  cached = json.loads(cache.read_text())
  cached["result"]["rc_em"], cached["parameters"] = 123.0, "another-model"
  cache.write_text(json.dumps(cached))
  assert experiment.main(args + ["--out", str(rerun), "--set", "eval.max_answer_length=5"]) == 0
  assert json.loads(rerun.read_text())["models"]["early"]["rc_em"] != 123.0

  # The notebook's code, top to bottom, writes the figure.
  figure = tmp_path / "results" / "validation.png"
  monkeypatch.setenv("DPJAX_VALIDATION_RESULTS", str(out))
  monkeypatch.setenv("DPJAX_VALIDATION_FIGURE", str(figure))
  notebook = json.loads((REPO / "experiments" / "notebooks" / "validation.ipynb").read_text())
  namespace = {}
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      exec(compile("".join(cell["source"]), "validation.ipynb", "exec"), namespace)
  assert figure.is_file() and figure.stat().st_size > 10_000
