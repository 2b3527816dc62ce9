"""``python -m tensorstore_h5.bench``: the benchmark (and its ``worker`` processes)."""

import sys

from .runner import main

sys.exit(main())
