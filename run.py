"""dpjax command line: `python run.py MODE --config experiments/x.py[:arg] --workdir DIR`.

The same as the `dpjax` command that `pip install .` puts on the PATH (`dpjax/cli.py`).
"""
import sys

from dpjax.cli import MODES, main  # noqa: F401  (MODES: the table of modes)

if __name__ == "__main__":
  sys.exit(main())
