#!/usr/bin/env python
"""Run the benchmark harness from a source checkout: ``python scripts/bench.py --help``.

The same as the ``mptrain-bench`` console command; everything lives in :mod:`mptrain.bench`.
"""

import sys

from mptrain.bench import main

if __name__ == "__main__":
    sys.exit(main())
