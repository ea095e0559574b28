"""``python -m mptrain.bench``: the same as the ``mptrain-bench`` console command."""

import sys

from mptrain.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
