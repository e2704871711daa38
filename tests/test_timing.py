"""experiments/benchmarks/timing.py: the batches searched and the searchers' turns."""
from conftest import load_script

timing = load_script("experiments/benchmarks/timing.py")


def test_batches_wrap_or_stop_at_the_end():
  qs = list("abcde")
  assert timing.batches_of(qs, 2, 5) == [["a", "b"], ["c", "d"], ["e"]]
  assert timing.batches_of(qs, 2, 2, first=1) == [["b", "c"], ["d", "e"]]
  assert timing.batches_of(qs, 3, 2, first=4, wrap=True) == [["e", "a", "b"], ["c", "d", "e"]]


class _Searcher:
  def __init__(self, name, calls):
    self.name, self.calls = name, calls

  def search(self, chunk, **kwargs):
    self.calls.append((self.name, list(chunk), kwargs))


def test_searchers_take_turns_on_the_same_batches():
  calls = []
  searchers = {"x": _Searcher("x", calls), "y": _Searcher("y", calls)}
  out = timing.time_searches(searchers, list("abcde"), 2, 3, k=10)
  assert [(n, c) for n, c, _ in calls] == [("x", ["a", "b"]), ("y", ["a", "b"]),
                                          ("x", ["c", "d"]), ("y", ["c", "d"]),
                                          ("x", ["e"]), ("y", ["e"])]
  assert all(kwargs == {"k": 10} for _, _, kwargs in calls)
  for figures in out.values():
    assert figures["batches"] == 3 and figures["questions"] == 5 and figures["batch"] == 2
    assert figures["questions_per_s"] > 0 and figures["questions_per_s_median_batch"] > 0
    assert figures["p50_ms"] <= figures["p90_ms"] <= figures["p99_ms"]
