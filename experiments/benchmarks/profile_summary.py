"""Where a traced program's device time goes: the XLA operations of a `jax.profiler` trace,
summed by operation and by kind (the Pallas flash kernel, matrix products, other fusions, copies),
with the device's busy and idle time over the traced steps.

The operations are the trace's events that carry an `hlo_op` statistic: the GPU's kernels (one
plane per device, `/device:GPU:N`) where the trace has them (CUPTI), else the XLA:CPU runtime's
thunks on the host plane. Busy time is the union of their intervals (kernels on several streams,
or thunks on several threads, count once); idle is the rest of the traced window, first operation
to last: time the device waited for the host (dispatch, Python) between or within steps.

  python experiments/benchmarks/profile_summary.py TRACE_DIR [--steps N] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib

# (kind, substrings of the kernel's or operation's lowercased name), first match wins
KINDS = (("flash attention", ("dpjax_flash",)),
         ("cudnn attention", ("sdpa", "fmha", "flash")),
         ("matmul", ("gemm", "nvjet", "cublas", "cutlass", "xmma", "matmul", "dot")),
         ("copy/transpose", ("copy", "transpose")),
         ("reduce", ("reduce",)),
         ("fusion", ("fusion",)))


def kind_of(name: str) -> str:
  lowered = name.lower()
  return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def _ops(plane) -> list[tuple[str, str, int, int]]:
  """(hlo op, event name, start ns, end ns) of the plane's events that are XLA operations."""
  out = []
  for line in plane.lines:
    for event in line.events:
      stats = dict(event.stats)
      if "hlo_op" in stats:
        out.append((str(stats["hlo_op"]), event.name, int(event.start_ns), int(event.end_ns)))
  return out


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
  busy, end = 0, None
  for start, stop in sorted(intervals):
    if end is None or start > end:
      busy, end = busy + stop - start, stop
    elif stop > end:
      busy, end = busy + stop - end, stop
  return busy


def trace_file(trace_dir: str | pathlib.Path) -> pathlib.Path:
  """The newest `*.xplane.pb` under a `jax.profiler.trace` directory."""
  files = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
  if not files:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir} (was the trace written?)")
  return files[-1]


def summarise(trace_dir: str | pathlib.Path, steps: int = 1, top: int = 25) -> dict:
  """Per step (the trace holds `steps` steps): the busy and idle ms of the plane that ran the
  operations, ms by kind, and the `top` operations by time (count, ms, their kernel's name)."""
  import jax
  path = trace_file(trace_dir)
  planes = [(p.name, _ops(p)) for p in jax.profiler.ProfileData.from_file(str(path)).planes]
  planes = [(name, ops) for name, ops in planes if ops]
  device = [(name, ops) for name, ops in planes if name.startswith("/device:")]
  if not planes:
    raise ValueError(f"{path}: no XLA operations in the trace")
  name, ops = (device or planes)[0]
  window = max(o[3] for o in ops) - min(o[2] for o in ops)
  busy = _busy_ns([(o[2], o[3]) for o in ops])
  by_op, kinds = collections.defaultdict(lambda: [0, 0, ""]), collections.Counter()
  for op, event, start, stop in ops:
    entry = by_op[op]
    entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + stop - start, entry[2] or event
    kinds[kind_of(f"{event} {op}")] += stop - start
  ms = lambda ns: round(ns / 1e6 / steps, 4)
  ranked = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]
  return {"plane": name, "device_planes": len(device), "steps": steps,
          "window_ms": ms(window), "busy_ms": ms(busy), "idle_ms": ms(window - busy),
          "operations": len(ops) // steps, "kinds_ms": {k: ms(v) for k, v in kinds.most_common()},
          "top": [{"op": op, "kernel": e[2], "count": e[0] // steps, "ms": ms(e[1])}
                  for op, e in ranked]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace_dir")
  parser.add_argument("--steps", type=int, default=1, help="steps the trace holds")
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args()
  print(json.dumps(summarise(args.trace_dir, args.steps, args.top), indent=1))


if __name__ == "__main__":
  main()
