"""The errors dpjax expects from bad input or a bad state: each names the file, record, field or
directory at fault and what to do. `run.py` prints them as one line and exits with status 2
(`EXPECTED`); anything else is a bug and keeps its traceback.
"""


class ConfigError(ValueError):
  """A config value that cannot work (reported with the field name, before any work starts)."""


class DataError(ValueError):
  """An input file that cannot be used at all (as opposed to a bad record, which is skipped)."""


class CheckpointError(ValueError):
  """A pretrained checkpoint that cannot be found or does not fit the encoder."""


class DumpError(RuntimeError):
  """A dump or index that is missing, incomplete, or does not match what it is used with."""


class DivergenceError(FloatingPointError):
  """Training diverged (a non-finite or exploding loss or gradient norm); nothing was saved."""


class Preempted(RuntimeError):
  """Training stopped on SIGTERM (a scheduler's preemption notice, `kill`) at a step boundary,
  with a checkpoint of that step: the same command resumes there. `run.py` exits with status
  143 (128 + SIGTERM), as a job killed by the signal would."""


class BusyError(DataError):
  """A workdir another live run is using."""


EXPECTED = (ConfigError, DataError, CheckpointError, DumpError, DivergenceError, BusyError)
