"""The soak's verdicts: measured only over two windows with good requests."""
from conftest import load_script

soak = load_script("experiments/benchmarks/serve_soak.py")


def _window(requests, rss, p99):
  return {"requests": requests, "rss_mb": rss, "p50_ms": p99 and p99 / 2, "p99_ms": p99,
          "statuses": {"200": 10}}


def test_verdicts_need_two_windows_with_good_requests():
  one = soak.verdicts({"windows": [_window(1000, 100.0, 50.0)], "unexpected": {}})
  assert one["ok"] is False and one["p99_last_over_first"] is None
  no_good = soak.verdicts({"windows": [_window(1000, 100.0, None), _window(2000, 100.0, 50.0)],
                           "unexpected": {}})
  assert no_good["ok"] is False and no_good["p99_last_over_first"] is None
  two = soak.verdicts({"windows": [_window(1000, 100.0, 50.0), _window(2000, 105.0, 60.0)],
                       "unexpected": {}})
  assert two["ok"] is True and abs(two["rss_growth_after_warmup"] - 0.05) < 1e-12
  assert two["p99_last_over_first"] == 60.0 / 50.0
  drift = soak.verdicts({"windows": [_window(1000, 100.0, 50.0), _window(2000, 100.0, 80.0)],
                         "unexpected": {}})
  assert drift["ok"] is False
  bad = soak.verdicts({"windows": [_window(1000, 100.0, 50.0), _window(2000, 100.0, 50.0)],
                       "unexpected": {"k: 200": 1}})
  assert bad["ok"] is False and bad["unexpected_statuses"] == 1
