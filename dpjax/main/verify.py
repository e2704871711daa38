"""`run.py verify`: every artifact of a workdir checked against its recorded digests."""
from __future__ import annotations

import logging

from dpjax.errors import DataError, DumpError
from dpjax.settings import Settings
from dpjax.workdir import Workdir
from dpjax.verify import artifacts

log = logging.getLogger(__name__)


def run(settings: Settings, workdir: str, allow_unverified: bool = False) -> dict:
  """`run.py verify`: checks every artifact of `workdir`; returns the paths verified, unverified
  and damaged ({path: problems}). Any damaged one, or with `allow_unverified` False any
  unverified one, is a DataError naming them (exit 2)."""
  del settings  # what is checked is what the workdir holds, whatever the config names
  workdir = Workdir(workdir)
  if not workdir.is_dir():
    raise DataError(f"{workdir}: no such workdir (check --workdir)")
  report = {"verified": [], "unverified": [], "damaged": {}}
  for path, check in artifacts(workdir):
    try:
      problems, rerun = check()
    except (DataError, DumpError) as e:  # a record that cannot be read: that is the damage
      problems, rerun = [str(e)], ""
    if problems is None:
      log.warning("%s: unverified (%s)", path, rerun)
      report["unverified"].append(str(path))
    elif problems:
      for problem in problems:
        log.error("%s%s", problem, f"; {rerun}" if rerun else "")
      report["damaged"][str(path)] = problems
    else:
      report["verified"].append(str(path))
  log.info("verify %s: %d artifacts verified, %d unverified, %d damaged", workdir,
           len(report["verified"]), len(report["unverified"]), len(report["damaged"]))
  if report["damaged"]:
    raise DataError(f"{workdir}: {len(report['damaged'])} damaged artifacts: "
                    f"{', '.join(report['damaged'])} (each file and what to rerun above)")
  if report["unverified"] and not allow_unverified:
    raise DataError(f"{workdir}: {len(report['unverified'])} artifacts without digests to check "
                    f"them by: {', '.join(report['unverified'])}; remake them, or pass "
                    "--allow_unverified to accept them")
  return report
