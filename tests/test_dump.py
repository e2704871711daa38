"""Dumping a corpus with a (tiny) model: no padding leaks, tokens once, resumable after a crash."""
import dataclasses
import errno
import json
import multiprocessing
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import SHARED_DATA
from dpjax.data.corpus import read_corpus, squad_to_jsonl
from dpjax.data.squad import Passage, SkipSummary
from dpjax.data.windows import build_windows
from dpjax.errors import DataError, DumpError
from dpjax.index import dump as dump_module
from dpjax.index import encode as encode_module
from dpjax.index import shard_stream as shard_stream_module
from dpjax.index import window_maker as windows_module
from dpjax.index.dump import dump_phrases
from dpjax.index.dump_reader import Dump
from dpjax.index.encode import encode_shard
from dpjax.index.manifest import DumpConfig
from dpjax.index.faiss_index import build_index
from dpjax.index.phrase_index import PhraseIndex
from dpjax.index.search import PhraseSearcher as SearchAPI
from dpjax.index.window_maker import WindowMaker, kept_runs, shard_windows
from dpjax.models import BertConfig, DensePhrases
from dpjax.models.densephrases import compute_dtype
from dpjax.models.encoders import bound
from dpjax.parallel import make_mesh

TINY = BertConfig(vocab_size=30522, hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=13, max_position_embeddings=64)
CONFIG = DumpConfig(max_seq_length=29, doc_stride=7, batch_size=8, shard_passages=3)


def _passages(n=8):
  words = "the quick brown fox jumps over a lazy dog near river banks at dawn".split()
  return [Passage(f"p{i}", f"Title {i % 3}", " ".join(words[: 3 + (7 * i) % 40] * 2))
          for i in range(n)]


@pytest.fixture(scope="module")
def model():
  return DensePhrases(TINY, rngs=nnx.Rngs(0))


def test_dump_keeps_each_context_token_once(model, tokenizer, tmp_path):
  passages = _passages()
  manifest = dump_phrases(model, tokenizer, passages, tmp_path, CONFIG, mesh=make_mesh())
  dump = Dump.load(tmp_path)
  assert manifest["complete"] and len(manifest["shards"]) == 3
  counts = [len(tokenizer.tokenize([p.text])[0][0]) for p in passages]
  assert manifest["num_tokens"] == sum(counts) == len(dump.vectors)  # no padding, no duplicate
  np.testing.assert_array_equal(np.bincount(dump.token_passage), counts)
  assert (np.diff(dump.token_passage) >= 0).all()  # contiguous per passage
  for row, p in enumerate(passages):
    spans = dump.char_spans[dump.token_passage == row]
    _, offsets = tokenizer.tokenize([p.text])[0]
    np.testing.assert_array_equal(spans, offsets)
  assert dump.vectors.dtype == np.float16 and np.isfinite(dump.vectors).all()
  assert dump.passages[5].id == "p5"


def test_dump_with_min_context_windows_keeps_each_token_once(model, tokenizer, tmp_path):
  passages = _passages()
  config = DumpConfig(max_seq_length=29, doc_stride=7, batch_size=8, shard_passages=3,
                      min_context=5)
  manifest = dump_phrases(model, tokenizer, passages, tmp_path, config, mesh=make_mesh())
  counts = [len(tokenizer.tokenize([p.text])[0][0]) for p in passages]
  assert manifest["num_tokens"] == sum(counts)
  # the windows encoded (shard 0 in blocks), counted as each shard's windows are cut
  cut = [shard_windows(tokenizer, passages[i:i + 3], config) for i in range(0, 8, 3)]
  assert [(s["windows"], s["encoded_tokens"]) for s in manifest["shards"]] == [
      (len(w.input_ids), w.attention_mask.sum()) for w in cut]
  assert manifest["num_windows"] == sum(len(w.input_ids) for w in cut) > len(passages)
  # each window's title ("title", "k") and [CLS]/[SEP]/[SEP], and the re-encoded contexts
  assert manifest["encoded_tokens"] > manifest["num_tokens"] + 5 * manifest["num_windows"]
  np.testing.assert_array_equal(np.bincount(Dump.load(tmp_path).token_passage), counts)
  assert manifest["host_seconds"] >= 0 and manifest["encoder_wait_seconds"] >= 0
  assert 0 <= manifest["host_cpu_seconds"] <= manifest["seconds"]
  assert 0 <= manifest["pipeline_wait_seconds"] <= manifest["host_seconds"]
  # the encoder calls' host side, parts of the host time (dispatch: placing and launching)
  assert manifest["dispatch_seconds"] >= 0 and manifest["fetch_seconds"] > 0
  assert manifest["dispatch_seconds"] + manifest["fetch_seconds"] <= manifest["host_seconds"]


def test_dump_with_tokenizing_processes_equals_the_threaded_dump(model, tokenizer, tmp_path):
  """Shards tokenized ahead by 2 spawned processes (several shards in flight, shard 0 in the
  thread) give the same dump as one thread."""
  passages = _passages(11)
  dump_phrases(model, tokenizer, passages, tmp_path / "thread", CONFIG, mesh=make_mesh())
  manifest = dump_phrases(model, tokenizer, passages, tmp_path / "processes", CONFIG,
                          mesh=make_mesh(), workers=2)
  assert len(manifest["shards"]) == 4
  a, b = Dump.load(tmp_path / "thread"), Dump.load(tmp_path / "processes")
  np.testing.assert_array_equal(a.vectors, b.vectors)
  np.testing.assert_array_equal(a.char_spans, b.char_spans)
  np.testing.assert_array_equal(a.token_passage, b.token_passage)
  assert [p.id for p in a.passages] == [p.id for p in b.passages] == [p.id for p in passages]


def test_window_maker_starts_every_worker_from_its_own_thread(tokenizer):
  """`WindowMaker.start` starts all the worker processes from a thread of its own (a spawn
  blocks the thread that starts it while the child imports the main module), so the shards
  submitted afterwards start none. Their windows are the thread's."""
  passages = _passages(5)
  before = len(multiprocessing.active_children())
  with WindowMaker(tokenizer, CONFIG, workers=2) as maker:
    maker.start()
    maker.handing.submit(lambda: None).result(timeout=60)  # after `start`'s submits
    assert len(multiprocessing.active_children()) == before + 2
    assert all(ready.result(timeout=60) > 0 for ready in maker.ready)
    got = maker.submit(passages).result(timeout=60)
    assert len(multiprocessing.active_children()) == before + 2
  want = shard_windows(tokenizer, passages, CONFIG)
  np.testing.assert_array_equal(got.input_ids, want.input_ids)
  np.testing.assert_array_equal(got.is_max_context, want.is_max_context)


def test_window_maker_reports_workers_that_cannot_start(tokenizer, monkeypatch):
  """Workers that cannot start (the pool refuses in the thread that hands it the jobs): the
  windows' future raises a DumpError that names the fallback, in the dump's thread."""
  class Refusing:
    def submit(self, *args):
      raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    def shutdown(self, **kwargs):
      pass

  monkeypatch.setattr(WindowMaker, "_pool", lambda self, started: Refusing())
  with WindowMaker(tokenizer, CONFIG, workers=2) as maker:
    maker.start()
    with pytest.raises(DumpError, match=r"2 tokenizing processes did not start or died "
                                        r"\(BlockingIOError.*index.dump_workers=0"):
      maker.submit(_passages(2)).result(timeout=60)


def test_streamed_shards_equal_the_in_memory_encoding(model, tokenizer, tmp_path):
  """Shards written batch by batch (`ShardStream`, the dump's way) hold exactly the arrays
  `encode_shard` builds in memory (validation's way): every kept token at its row."""
  passages = _passages(11)
  config = dataclasses.replace(CONFIG, min_context=3)  # several runs per passage
  dump_phrases(model, tokenizer, passages, tmp_path, config, mesh=make_mesh())
  encode = bound(model, "phrases_and_filter")
  for n, lo in enumerate(range(0, len(passages), config.shard_passages)):
    chunk = passages[lo:lo + config.shard_passages]
    want = encode_shard(tokenizer, chunk, config, make_mesh(), encode)
    for key, value in want.items():
      got = np.load(tmp_path / f"shard_{n:05d}" / f"{key}.npy")
      assert got.dtype == value.dtype, key
      np.testing.assert_array_equal(got, value, err_msg=key)
  assert not list(tmp_path.glob("*.tmp"))


def test_shard_tables_are_written_before_the_last_blocks_vectors(model, tokenizer, monkeypatch):
  """A streamed shard's tables (token rows, spans, passages) go to the writer as soon as its last
  block of windows is made, before that block's vectors: finishing the shard then only writes
  the .npy headers and renames it (the end of a dump waits for no shard-sized write)."""
  passages = _passages(40)
  config = dataclasses.replace(CONFIG, shard_passages=40, min_context=3)
  monkeypatch.setattr(windows_module, "FIRST_BLOCK", 4)  # blocks of 4, 8, 16 and 12 passages
  maker = WindowMaker(tokenizer, config)
  with maker:
    blocks = [(count, future.result()) for count, future in maker.submit_blocks(passages)]
  events = []

  class Sink:
    def add(self, runs, rows, vectors, logits):
      events.append(("add", len(rows)))

    def tables(self, arrays, passages_, windows):
      events.append(("tables", {k: v.copy() for k, v in arrays.items()}, len(passages_),
                     windows))

  out = encode_shard(tokenizer, passages, config, make_mesh(), bound(model, "phrases_and_filter"),
                     windows=blocks, stream=Sink)
  tables = [i for i, e in enumerate(events) if e[0] == "tables"]
  assert len(tables) == 1 and 0 < tables[0] < len(events) - 1, events  # adds before and after
  _, arrays, count, windows = events[tables[0]]
  assert count == 40 and sorted(arrays) == sorted(out) == ["char_spans", "token_passage"]
  assert windows == {"windows": sum(len(b.input_ids) for _, b in blocks),  # all 4 blocks'
                     "encoded_tokens": sum(b.attention_mask.sum() for _, b in blocks)}
  for key, value in out.items():
    np.testing.assert_array_equal(arrays[key], value, err_msg=key)


def test_shard_0_encoded_in_blocks_equals_the_whole_shard(model, tokenizer, tmp_path,
                                                          monkeypatch):
  """Shard 0's windows made in blocks (`WindowMaker.submit_blocks`: here 1, 2, 4, then 4 of
  its 11 passages) and encoded block by block give the shard of its windows
  encoded at once: the same tokens at the same rows, passage rows and spans, and the same
  vectors (the calls hold other windows, so widths differ: equal to float16 rounding), in as
  many calls, all full but the last (a block's windows that would fill a call in part go with
  the next block's). The in-memory encoding of the same blocks equals the streamed one
  exactly."""
  passages = _passages(11)
  config = dataclasses.replace(CONFIG, shard_passages=11, min_context=3)
  monkeypatch.setattr(windows_module, "FIRST_BLOCK", 1)
  made = []
  submit_blocks = WindowMaker.submit_blocks
  monkeypatch.setattr(WindowMaker, "submit_blocks",
                      lambda self, ps: made.append(submit_blocks(self, ps)) or made[-1])
  manifest = dump_phrases(model, tokenizer, passages, tmp_path, config, mesh=make_mesh())
  assert [count for count, _ in made[0]] == [1, 2, 4, 4] and manifest["num_passages"] == 11
  encode = bound(model, "phrases_and_filter")
  calls = {"whole": [], "blocks": []}
  counted = lambda name: lambda ids, mask: calls[name].append(ids.shape) or encode(ids, mask)
  whole = encode_shard(tokenizer, passages, config, make_mesh(), counted("whole"))
  blocks = encode_shard(tokenizer, passages, config, make_mesh(), counted("blocks"),
                        windows=[(c, f.result()) for c, f in made[0]])
  # 1, 3, 7 and 7 windows: the calls of the whole shard's 18, 3 of 8 (without the carry, 4)
  assert sorted(calls["blocks"]) == sorted(calls["whole"]) and len(calls["whole"]) == 3
  for key, value in whole.items():
    got = np.load(tmp_path / "shard_00000" / f"{key}.npy")
    assert got.dtype == value.dtype and got.shape == value.shape, key
    np.testing.assert_array_equal(got, blocks[key], err_msg=key)
    if key in ("vectors", "filter_logits"):
      np.testing.assert_allclose(got.astype(np.float32), value.astype(np.float32), rtol=2e-3,
                                 atol=2e-3, err_msg=key)
    else:
      np.testing.assert_array_equal(got, value, err_msg=key)


def test_failed_write_mid_shard_leaves_nothing_and_the_rerun_resumes(model, tokenizer,
                                                                       tmp_path, monkeypatch):
  """Disk full while a shard's rows are written: a DumpError naming the shard and the cause,
  no unfinished shard left, the shards before it kept; the rerun finishes the same dump."""
  passages = _passages()
  dump_phrases(model, tokenizer, passages, tmp_path / "clean", CONFIG, mesh=make_mesh())
  calls, pwrite = [], shard_stream_module.os.pwrite

  def full_in_the_second_shard(fd, data, offset):  # only shard 1's files (Linux: /proc)
    if "shard_00001.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
      calls.append(offset)
      raise OSError(errno.ENOSPC, "No space left on device")
    return pwrite(fd, data, offset)

  monkeypatch.setattr(shard_stream_module.os, "pwrite", full_in_the_second_shard)
  with pytest.raises(DumpError, match=r"shard_00001: could not write the shard: No space left "
                                      r"on device \(errno 28\)"):
    dump_phrases(model, tokenizer, passages, tmp_path / "broken", CONFIG, mesh=make_mesh())
  assert calls and not list((tmp_path / "broken").glob("*.tmp"))
  assert not (tmp_path / "broken" / "shard_00001").exists()
  monkeypatch.setattr(shard_stream_module.os, "pwrite", pwrite)
  manifest = dump_phrases(model, tokenizer, passages, tmp_path / "broken", CONFIG,
                          mesh=make_mesh())
  assert manifest["complete"]
  a, b = Dump.load(tmp_path / "clean"), Dump.load(tmp_path / "broken")
  np.testing.assert_array_equal(a.vectors, b.vectors)
  np.testing.assert_array_equal(a.filter_logits, b.filter_logits)


def test_length_bucketed_dump_equals_full_width_encoding(model, tokenizer, tmp_path):
  """Batches cut to their longest window (longest first) change no vector and no token order."""
  config = DumpConfig(max_seq_length=64, doc_stride=16, batch_size=8, shard_passages=12)
  passages = _passages(12)
  dump_phrases(model, tokenizer, passages, tmp_path, config, mesh=make_mesh())
  dump = Dump.load(tmp_path)
  windows, _ = build_windows(tokenizer, passages,
                             max_seq_length=64, doc_stride=16, include_title=True)
  lengths = np.sort(windows.attention_mask.sum(1))
  assert lengths[:len(lengths) % 8 or 8].max() <= 32 < lengths.max()  # the last batch is cut
  h = np.asarray(model.encode_phrases(jnp.asarray(windows.input_ids),
                                      jnp.asarray(windows.attention_mask)))
  keep = windows.context_mask & windows.is_max_context
  np.testing.assert_allclose(dump.vectors.astype(np.float32), h[keep], rtol=2e-3, atol=2e-3)


def test_bfloat16_dump_of_a_float32_model(model, tokenizer, tmp_path):
  """`compute_dtype="bfloat16"`: the same tokens, vectors near the float32 dump's (bf16 products
  of a 1-layer encoder), the dtype in the manifest's settings; the model itself is untouched,
  and resuming the dump in the other dtype is refused."""
  passages = _passages()
  bf16 = dataclasses.replace(CONFIG, compute_dtype="bfloat16")
  a = dump_phrases(model, tokenizer, passages, tmp_path / "fp32", CONFIG, mesh=make_mesh())
  b = dump_phrases(model, tokenizer, passages, tmp_path / "bf16", bf16, mesh=make_mesh())
  assert a["settings"]["compute_dtype"] == "float32"
  assert b["settings"]["compute_dtype"] == "bfloat16" and a["dump_id"] != b["dump_id"]
  assert a["fingerprint"] == b["fingerprint"] and compute_dtype(model) == "float32"
  x, y = Dump.load(tmp_path / "fp32"), Dump.load(tmp_path / "bf16")
  np.testing.assert_array_equal(x.char_spans, y.char_spans)
  diff = np.abs(x.vectors.astype(np.float32) - y.vectors.astype(np.float32))
  assert 0 < diff.max() < 0.1 and diff.mean() < 0.02 * np.abs(x.vectors).mean()
  with pytest.raises(DumpError, match="compute_dtype .float32. .now .bfloat16.."):
    dump_phrases(model, tokenizer, passages, tmp_path / "fp32", bf16, mesh=make_mesh())
  # A dump from before the setting existed (format 1) was made in float32: resumed as such.
  manifest = json.loads((tmp_path / "fp32" / "manifest.json").read_text())
  del manifest["settings"]["compute_dtype"], manifest["format"]
  (tmp_path / "fp32" / "manifest.json").write_text(json.dumps(manifest))
  assert dump_phrases(model, tokenizer, passages, tmp_path / "fp32", CONFIG,
                      mesh=make_mesh())["complete"]
  with pytest.raises(DumpError, match="other settings"):
    dump_phrases(model, tokenizer, passages, tmp_path / "fp32", bf16, mesh=make_mesh())


def test_widths_compiled_ahead_leave_the_dump_nothing_to_compile(tokenizer, tmp_path,
                                                                 monkeypatch):
  """On an accelerator the dump compiles the phrase encoder for every call width before its first
  call, all widths at once (`compile_ahead`; here 16 and 29, the windows' own width), when its
  corpus fills a shard: its calls then load no executable, neither compiled nor from the persistent
  cache, and it stores what a dump that compiles as it goes stores. (A model of shapes no other
  test compiles.)"""
  model = DensePhrases(dataclasses.replace(TINY, intermediate_size=11), rngs=nnx.Rngs(0))
  config = dataclasses.replace(CONFIG, shard_passages=6, min_context=3)
  passages = _passages(11)
  loads = []  # executables compiled or read from the persistent compilation cache
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **kwargs: loads.append(event) if event.endswith(
          ("backend_compile_duration", "cache_retrieval_time_sec")) else None)
  after_ahead = []
  compile_ahead = dump_module.compile_ahead

  def counted(*args):
    shapes = compile_ahead(*args)
    after_ahead.append(len(loads))
    return shapes
  monkeypatch.setattr(dump_module, "compile_ahead", counted)
  monkeypatch.setattr(dump_module, "_compile_ahead", lambda mesh: True)
  ahead = dump_phrases(model, tokenizer, passages, tmp_path / "ahead", config, mesh=make_mesh())
  assert ahead["compile_ahead_shapes"] == 2 and ahead["compile_ahead_seconds"] > 0
  assert len(after_ahead) == 1 and after_ahead[0] >= 2 and len(loads) == after_ahead[0]
  assert ahead["host_seconds"] > 0
  monkeypatch.setattr(dump_module, "_compile_ahead", lambda mesh: False)  # a CPU's way
  plain = dump_phrases(model, tokenizer, passages, tmp_path / "plain", config, mesh=make_mesh())
  assert plain["compile_ahead_shapes"] == 0 and len(loads) == after_ahead[0]  # the same calls
  other = dump_phrases(model, tokenizer, passages, tmp_path / "other",
                       dataclasses.replace(config, batch_size=16), mesh=make_mesh())
  assert len(loads) > after_ahead[0] and len(after_ahead) == 1  # 16-row calls: compiled now
  for shard in ("shard_00000", "shard_00001"):
    for key in ("vectors", "filter_logits", "token_passage", "char_spans"):
      np.testing.assert_array_equal(np.load(tmp_path / "ahead" / shard / f"{key}.npy"),
                                    np.load(tmp_path / "plain" / shard / f"{key}.npy"))
  assert ahead["num_tokens"] == plain["num_tokens"] == other["num_tokens"]
  monkeypatch.setattr(dump_module, "_compile_ahead", lambda mesh: True)
  one_shard = dump_phrases(model, tokenizer, passages, tmp_path / "one", dataclasses.replace(
      config, shard_passages=12), mesh=make_mesh())  # 11 passages
  assert one_shard["compile_ahead_shapes"] == 0 and len(after_ahead) == 1


def test_dump_width_multiple_sets_the_call_widths_not_the_vectors(model, tokenizer, tmp_path):
  """`width_multiple` rounds the calls' widths to its multiples instead of the platform's (16 on
  a CPU; here 4); the vectors are the same up to rounding, so the manifest records it apart from
  the settings a dump is refused or resumed by."""
  passages = _passages(11)
  config = dataclasses.replace(CONFIG, shard_passages=11, min_context=3)
  encode = bound(model, "phrases_and_filter")
  widths = {0: set(), 4: set()}
  for multiple in widths:
    counted = lambda ids, mask, m=multiple: widths[m].add(ids.shape[1]) or encode(ids, mask)
    out = encode_shard(tokenizer, passages, dataclasses.replace(config, width_multiple=multiple),
                       make_mesh(), counted)
    if multiple:
      np.testing.assert_allclose(out["vectors"].astype(np.float32),
                                 default["vectors"].astype(np.float32), atol=2e-3, rtol=2e-3)
    default = out
  assert widths[0] <= {16, 29} and all(w % 4 == 0 or w == 29 for w in widths[4])
  assert widths[4] - {16, 29}, widths  # some call is narrower than at multiples of 16
  manifest = dump_phrases(model, tokenizer, passages, tmp_path, dataclasses.replace(
      config, width_multiple=4), mesh=make_mesh())
  assert manifest["width_multiple"] == 4 and "width_multiple" not in manifest["settings"]
  again = dump_phrases(model, tokenizer, passages, tmp_path, config, mesh=make_mesh())
  assert again["dump_id"] == manifest["dump_id"]  # complete: reused at the platform's multiple


def test_a_blocks_windows_held_back_are_those_that_fill_no_call_of_one_width():
  """`_Windows.split`: of each width's windows (lengths rounded up to 4), the longest multiple of
  3 (a call's rows) are encoded now, the rest held; every window keeps its own kept runs through
  `split` and `concat`, and every window is on one side once."""
  lengths = np.array([5, 3, 8, 7, 2, 6, 4])  # widths 8: lengths 8, 7, 6, 5; 4: 4, 3, 2
  mask = (np.arange(8) < lengths[:, None]).astype(np.int32)
  ids = mask * np.arange(1, 8)[:, None]  # window w's tokens are w + 1
  rng = np.random.default_rng(0)
  keep = mask.astype(bool) & (rng.random(mask.shape) < 0.7)
  runs = kept_runs(keep)
  windows = encode_module._Windows(ids, mask, {k: runs[k].tolist() for k in runs}, keep.sum(1))
  now, held = windows.split(3, 4)
  assert now.attention_mask.sum(1).tolist() == [8, 7, 6, 4, 3, 2]
  assert held.attention_mask.sum(1).tolist() == [5]

  def slices(w):  # window (by its tokens) -> its runs as (column, length, destination)
    return {int(w.input_ids[i, 0]): [(w.runs["column"][r], w.runs["length"][r],
                                      w.runs["destination"][r])
                                     for r in range(w.runs["first"][i], w.runs["first"][i + 1])]
            for i in range(len(w.kept))}

  together = held.concat(now)
  assert slices(together) == slices(windows) == {**slices(now), **slices(held)}
  assert together.kept.tolist() == [int(keep[w - 1].sum()) for w in together.input_ids[:, 0]]


def test_kept_runs_copy_the_kept_tokens_in_passage_order():
  """Runs of kept columns (several per window, none, at either edge) copied as slices give
  exactly the boolean gather in (window, column) order."""
  rng = np.random.default_rng(0)
  keep = rng.random((9, 13)) < 0.5
  keep[2] = False
  keep[3] = True
  x = rng.standard_normal((9, 13, 4))
  runs = kept_runs(keep)
  assert runs["first"][3] + 1 == runs["first"][4] and runs["first"][2] == runs["first"][3]
  out = np.full((int(keep.sum()), 4), np.nan)
  for w, c, n, d in zip(runs["window"], runs["column"], runs["length"], runs["destination"]):
    assert keep[w, c:c + n].all()
    out[d:d + n] = x[w, c:c + n]
  np.testing.assert_array_equal(out, x[keep])
  for w in range(9):
    assert (runs["window"][runs["first"][w]:runs["first"][w + 1]] == w).all()


def test_dump_resumes_after_a_crash(model, tokenizer, tmp_path):
  passages = _passages()
  dump_phrases(model, tokenizer, passages, tmp_path / "straight", CONFIG, mesh=make_mesh())

  def crashing():
    for i, p in enumerate(passages):
      if i == 5:
        raise KeyboardInterrupt("killed")
      yield p
  broken = tmp_path / "broken"
  with pytest.raises(KeyboardInterrupt):
    dump_phrases(model, tokenizer, crashing(), broken, CONFIG, mesh=make_mesh())
  assert not json.loads((broken / "manifest.json").read_text())["complete"]
  with pytest.raises(DumpError, match="incomplete"):
    Dump.load(broken)
  # A half-written shard: its tables and info are written before its last vectors are
  # (`ShardStream.tables`), so a kill can leave them in the temporary directory.
  (broken / "shard_00001.tmp").mkdir()
  (broken / "shard_00001.tmp" / "shard.json").write_text(
      json.dumps({"name": "shard_00001", "passages": 5, "tokens": 1, "passages_sha": "x"}))
  dump_phrases(model, tokenizer, passages, broken, CONFIG, mesh=make_mesh())
  a, b = Dump.load(tmp_path / "straight"), Dump.load(broken)
  np.testing.assert_array_equal(a.vectors, b.vectors)
  np.testing.assert_array_equal(a.token_passage, b.token_passage)
  other = DensePhrases(TINY, rngs=nnx.Rngs(1))
  with pytest.raises(DumpError, match="another model"):
    dump_phrases(other, tokenizer, passages, broken, CONFIG, mesh=make_mesh())
  # Search checks that the question encoders belong to the model that made the vectors.
  build_index(broken, "Flat")
  index = PhraseIndex(broken, "Flat")
  SearchAPI(model, index, tokenizer, max_query_length=8, batch_size=8)
  with pytest.raises(DumpError, match="fingerprints differ"):
    SearchAPI(other, index, tokenizer)


def test_search_api_tokenizes_questions_as_the_dump_says(model, tokenizer, tmp_path):
  """`PhraseSearcher(model, index)` without a tokenizer takes the one the dump's manifest names
  (`run.py dump` records `model.tokenizer`): it took MiniLM's whatever made the dump."""
  vocab = tmp_path / "vocab"
  vocab.mkdir()
  (vocab / "config.json").write_text("{}")
  (vocab / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "fox"]))
  dump_phrases(model, tokenizer, _passages(3), tmp_path / "d", CONFIG, mesh=make_mesh(),
               model_info={"tokenizer": str(vocab)})
  build_index(tmp_path / "d", "Flat")
  named = SearchAPI(model, PhraseIndex(tmp_path / "d", "Flat"), max_query_length=8, batch_size=8)
  assert named.tokenizer.vocab_size == 6
  dump_phrases(model, tokenizer, _passages(3), tmp_path / "old", CONFIG, mesh=make_mesh())
  build_index(tmp_path / "old", "Flat")  # a dump that names none: MiniLM's, with a warning
  assert SearchAPI(model, PhraseIndex(tmp_path / "old", "Flat")).tokenizer.vocab_size == 30522


def test_corpus_formats_and_bad_records(tmp_path):
  jsonl = tmp_path / "c.jsonl"
  jsonl.write_text('{"id": "x", "title": "T", "text": "hello"}\n'
                   'not json\n'
                   '{"id": "y", "title": "T"}\n'
                   '{"id": "x", "text": "again"}\n'
                   '{"contents": "pyserini style"}\n')
  summary = SkipSummary()
  passages = list(read_corpus(jsonl, summary))
  assert [p.id for p in passages] == ["x", "c-5"]
  assert summary.counts == {"invalid JSON line": 1, "passage without text": 1,
                            "duplicate passage id": 1}
  assert "c.jsonl:2" in str(summary)
  with pytest.raises(DataError, match="not found"):
    list(read_corpus(tmp_path / "missing.json"))
  (tmp_path / "bad.json").write_text('{"data": [')
  with pytest.raises(DataError, match="invalid JSON at line 1"):
    list(read_corpus(tmp_path / "bad.json"))


def test_custom_example_corpus():
  path = SHARED_DATA / "custom-example" / "articles.json"
  if not path.is_file():
    pytest.skip(f"{path} not found")
  passages = list(read_corpus(path))
  assert len(passages) == 112 and len({p.title for p in passages}) == 4


@pytest.mark.slow
def test_squad_corpus_has_20958_unique_paragraphs(squad_dir, tmp_path):
  count = squad_to_jsonl([squad_dir / "train-v1.1.json", squad_dir / "dev-v1.1.json"],
                         tmp_path / "corpus.jsonl")
  assert count == 20958  # 20,963 paragraphs, 5 of them exact repeats within their article


def test_in_memory_encoding_of_passages_without_tokens_gives_empty_arrays(model, tokenizer):
  """`encode_shard` without a stream (validation's subcorpora) of passages that hold no token:
  empty vectors and logits of the right widths (no array was made: the callers' KeyError)."""
  out = encode_shard(tokenizer, [Passage("e1", "T", ""), Passage("e2", "T", "   ")], CONFIG,
                     make_mesh(), bound(model, "phrases_and_filter"))
  assert {k: v.shape for k, v in out.items()} == {
      "token_passage": (0,), "char_spans": (0, 2), "vectors": (0, TINY.hidden_size),
      "filter_logits": (0, 2)}


def test_missing_metadata_and_empty_corpus(model, tokenizer, tmp_path):
  dump_phrases(model, tokenizer, _passages(4), tmp_path / "d", CONFIG, mesh=make_mesh())
  (tmp_path / "d" / "shard_00001" / "char_spans.npy").unlink()
  # (named by the sizes recorded at its writing, before numpy reads it)
  with pytest.raises(DumpError, match="shard_00001/char_spans.npy: No such file or directory: "
                                      "the dump is damaged; delete .*shard_00001"):
    Dump.load(tmp_path / "d")
  with pytest.raises(DumpError, match="corpus is empty"):
    dump_phrases(model, tokenizer, [], tmp_path / "empty", CONFIG, mesh=make_mesh())
  no_shards = dataclasses.replace(CONFIG, shard_passages=0)  # not "the corpus is empty"
  with pytest.raises(DumpError, match=r"shard_passages \(0\).*at least 1"):
    dump_phrases(model, tokenizer, _passages(4), tmp_path / "zero", no_shards, mesh=make_mesh())
