"""``python -m tensorstore_h5``: the ``tensorstore-h5`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
