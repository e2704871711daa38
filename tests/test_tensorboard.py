"""TensorBoard event files mirror the metrics files: the scalars read back at their steps."""
import json
import pathlib
import struct

import jax
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from dpjax.workdir import Workdir, tensorboard_run
from dpjax.trainer import MetricsWriter, scalars

RECORDS = [
    {"step": 1, "split": "train", "epoch": 0, "loss": 0.5, "note": "text", "finished": True,
     "unset": None, "list": [1, 2]},
    {"step": 2, "split": "train", "epoch": 0, "loss": 0.25},
    {"step": 2, "split": "dev", "rc_f1": 12.5, "count": 7, "report": {"em@1": 3.0}},
    {"step": 3, "split": "train", "epoch": 1, "loss": 0.125},
]


def read_events(folder: pathlib.Path) -> list:
  """The events of a folder's event files (by name), each record's length and data checked
  against its masked CRC-32C (the TFRecord framing TensorBoard reads)."""
  events = []
  for path in sorted(folder.glob("events.out.tfevents.*")):
    data, offset = path.read_bytes(), 0
    while offset < len(data):
      header = data[offset:offset + 8]
      (length,), (header_crc,) = struct.unpack("<Q", header), struct.unpack(
          "<I", data[offset + 8:offset + 12])
      body = data[offset + 12:offset + 12 + length]
      (body_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
      assert header_crc == masked_crc32c(header) and body_crc == masked_crc32c(body), path
      events.append(event_pb2.Event.FromString(body))
      offset += 16 + length
  return events


def read_scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of a folder's event files, in the order written."""
  out = {}
  for event in read_events(folder):
    for value in event.summary.value:
      out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def test_every_numeric_field_is_a_scalar_at_its_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  writer = MetricsWriter(path, 0)
  for record in RECORDS:
    writer.write(record)
  # Flushed with each record: read before the writer is closed, as from a killed run.
  folder = tmp_path / "tensorboard" / "train"
  assert writer.tensorboard == folder == Workdir(tmp_path).tensorboard / "train"
  assert read_scalars(folder) == {
      "train/epoch": [(1, 0.0), (2, 0.0), (3, 1.0)],
      "train/loss": [(1, 0.5), (2, 0.25), (3, 0.125)],
      "dev/rc_f1": [(2, 12.5)],
      "dev/count": [(2, 7.0)],
      "dev/report/em@1": [(2, 3.0)],
  }
  assert read_events(folder)[0].file_version == "brain.Event:2"
  writer.close()
  assert [json.loads(line) for line in path.read_text().splitlines()] == RECORDS


def test_run_names():
  assert tensorboard_run(pathlib.Path("w/metrics.jsonl")) == pathlib.Path("w/tensorboard/train")
  assert (tensorboard_run(pathlib.Path("w/qsft_metrics.jsonl"))
          == pathlib.Path("w/tensorboard/qsft"))
  assert (tensorboard_run(pathlib.Path("w/teacher/metrics.jsonl"))
          == pathlib.Path("w/teacher/tensorboard/train"))
  assert scalars({"step": 4, "loss": 1}) == {"loss": 1.0}


def test_a_resume_drops_the_steps_the_metrics_file_drops(tmp_path):
  """Resumed at step 2, the event files hold the file's records up to step 2, then the new
  ones; `drop` removes a record from both; a fresh start (-1) empties both."""
  path = tmp_path / "metrics.jsonl"
  with MetricsWriter(path, 0) as writer:
    for record in RECORDS:
      writer.write(record)
  folder = tensorboard_run(path)
  with MetricsWriter(path, 2) as writer:
    assert read_scalars(folder)["train/loss"] == [(1, 0.5), (2, 0.25)]
    writer.write({"step": 3, "split": "train", "loss": 2.0})
    writer.write({"step": 4, "split": "train", "loss": 4.0})
    assert read_scalars(folder)["train/loss"] == [(1, 0.5), (2, 0.25), (3, 2.0), (4, 4.0)]
    assert read_scalars(folder)["dev/rc_f1"] == [(2, 12.5)]
    writer.drop(2, "dev")
    assert "dev/rc_f1" not in read_scalars(folder)
    writer.write({"step": 2, "split": "dev", "rc_f1": 25.0})
  assert read_scalars(folder) == {
      "train/epoch": [(1, 0.0), (2, 0.0)],
      "train/loss": [(1, 0.5), (2, 0.25), (3, 2.0), (4, 4.0)],
      "dev/rc_f1": [(2, 25.0)],
  }
  assert len(list(folder.glob("events.out.tfevents.*"))) == 1
  MetricsWriter(path, -1)
  assert path.read_text() == "" and read_scalars(folder) == {}


def test_written_after_close_into_a_new_file(tmp_path):
  writer = MetricsWriter(tmp_path / "qsft_metrics.jsonl", -1)
  writer.write({"step": 0, "split": "dev", "em@1": 1.5})
  writer.close()
  writer.write({"step": 1, "split": "dev", "em@1": 2.5})
  folder = tmp_path / "tensorboard" / "qsft"
  assert len(list(folder.glob("events.out.tfevents.*"))) == 2
  assert read_scalars(folder) == {"dev/em@1": [(0, 1.5), (1, 2.5)]}


def test_only_the_main_process_writes(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  writer = MetricsWriter(tmp_path / "metrics.jsonl", 0)
  writer.write(RECORDS[0])
  assert list(tmp_path.iterdir()) == []


def test_a_failed_event_write_raises(tmp_path):
  """As a failed metrics line does: training does not go on without its log."""
  (tmp_path / "tensorboard").write_text("a file where the folder goes")
  writer = MetricsWriter(tmp_path / "metrics.jsonl", 0)
  with pytest.raises(OSError):
    writer.write(RECORDS[1])


def test_tensorboard_reads_the_scalars(tmp_path):
  """TensorBoard's own reader (when installed) sees the same steps and values."""
  accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  path = tmp_path / "metrics.jsonl"
  with MetricsWriter(path, 0) as writer:
    for record in RECORDS:
      writer.write(record)
  with MetricsWriter(path, 2) as writer:  # resumed: a second event file replaces the first
    writer.write({"step": 3, "split": "train", "loss": 2.0})
  events = accumulator.EventAccumulator(str(tensorboard_run(path))).Reload()
  assert set(events.Tags()["scalars"]) == {"train/epoch", "train/loss", "dev/rc_f1",
                                            "dev/count", "dev/report/em@1"}
  assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25),
                                                                         (3, 2.0)]
  assert [(e.step, e.value) for e in events.Scalars("dev/count")] == [(2, 7.0)]


def test_without_tensorboardx_the_metrics_file_is_written_and_stale_events_go(
    tmp_path, monkeypatch, caplog):
  path = tmp_path / "metrics.jsonl"
  with MetricsWriter(path, 0) as writer:
    writer.write(RECORDS[0])
  folder = tmp_path / "tensorboard" / "train"
  assert read_scalars(folder)  # events of an earlier run, with tensorboardX
  monkeypatch.setattr("dpjax.trainer.EventsWriter", None)
  with caplog.at_level("WARNING", logger="dpjax.trainer"):
    with MetricsWriter(path, 1) as writer:  # resumed after step 1
      for record in RECORDS[1:]:
        writer.write(record)
  assert [json.loads(line) for line in path.read_text().splitlines()] == RECORDS
  # No event file, not even the earlier run's: they would hold only part of the file's records.
  assert not list(folder.glob("events.out.tfevents.*"))
  warnings = [r for r in caplog.records if "tensorboardX is not installed" in r.getMessage()]
  assert len(warnings) == 1 and "metrics.jsonl" in warnings[0].getMessage()
