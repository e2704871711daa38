"""One program per mode of the command line: `dpjax.main.<mode>.run(settings, workdir, ...)`,
given the config's typed sections (`dpjax.settings.Settings`) by `config.run_in_workdir`."""
import functools
import pathlib
from typing import Sequence

from dpjax import distributed, loading
from dpjax.config import load_settings
from dpjax.data.questions import read_questions
from dpjax.index.dump_reader import Dump
from dpjax.io import workdir_lock
from dpjax.settings import Settings
from dpjax.workdir import Workdir


def writes_to(mode):
  """A `run.py` mode `mode(settings, workdir, ...)` that writes into its workdir, run under the
  workdir's lock (`Workdir.lock`, held by process 0 of a job): one writer at a time, a second
  one refused at once naming the first one's pid and command (two dumps in one workdir removed
  each other's shards); the lock of a run that is gone is taken over with a warning."""
  @functools.wraps(mode)
  def run(settings: Settings, workdir, *args, **kwargs):
    workdir = Workdir(workdir)
    if not distributed.is_main():
      return mode(settings, workdir, *args, **kwargs)
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
      with workdir_lock(workdir.lock, ""):
        return mode(settings, workdir, *args, **kwargs)
    except BaseException:
      if created and workdir.is_dir() and not any(workdir.iterdir()):
        workdir.rmdir()  # a refused run in a mistyped workdir leaves no empty folder behind
      raise
  return run


def restore(settings: Settings, workdir, step: int | None = None, **kwargs):
  """(model, step) of the workdir's checkpoint that the config names (`loading.restore_model`
  with the model, data, eval and validation sections)."""
  return loading.restore_model(settings.model, settings.data, settings.eval, workdir, step,
                               best_metric=settings.validation.metric, **kwargs)


def open_searcher(settings: Settings, workdir, index_name: str | None = None, *,
                  verify: bool = False):
  """(PhraseSearcher, step) over the workdir's index as the config describes it
  (`loading.load_searcher` with the model, data, eval, index and validation sections)."""
  return loading.load_searcher(settings.model, settings.data, settings.eval, settings.index,
                               workdir, index_name, best_metric=settings.validation.metric,
                               verify=verify)


def open_workdir(config_spec: str, workdir: str | pathlib.Path, overrides: Sequence[str] = ()):
  """What analysis code starts from: `(settings, workdir, dump, questions)` of a workdir that
  has a complete dump (notebooks, `experiments/benchmarks/*`), the config's typed sections
  (`Settings`) first."""
  settings = load_settings(config_spec, overrides)
  workdir = Workdir(workdir)
  paths = loading.data_paths(settings.data, settings.index, workdir)
  return settings, workdir, Dump.load(paths["dump"]), read_questions(paths["questions"])
