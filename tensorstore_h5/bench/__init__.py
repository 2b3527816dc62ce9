"""The benchmark (``tensorstore-h5 bench``; bench/README.md): tensorstore_h5 against the
machine's limits and its peers. The library never imports this package.

- :mod:`.runner`: rounds of fresh worker processes, best / median, ratios (``run``, ``main``)
- :mod:`.contenders`: what each contender times; :mod:`.measure`: peak RSS, page cache, raw reads
- :mod:`.args`: the command line's options (no torch: ``tensorstore-h5 bench --help`` stays fast)
- :mod:`.gpu`: the GPU group (``--gpu``), :mod:`.firstcall`: the first call in a fresh process
- groups run by their own drivers: :mod:`.distributed` (DCP, several ranks), :mod:`.past_ram`,
  :mod:`.remote` (a loopback HTTP server), :mod:`.compression`
- inputs: :mod:`.synthetic` (checkpoints made here), :mod:`.realweights` (a small trained model);
  :mod:`.simulate` (ranks of a DCP save, simulated in one process); :mod:`.loopback` (the HTTP
  range server of the remote bench and the tests)

Only this package imports ``pickle``: to measure peers that use it.

Importing the package imports none of them; the runner's names are found here on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_RUNNER = frozenset({"run", "run_args", "main", "worker", "ORDER", "GPU_ORDER", "COLD_ORDER", "ContenderFailed"})
_CONTENDERS = frozenset({"CONTENDERS", "READS", "Ctx", "Timed", "contender"})
_MEASURE = frozenset({"Skip", "reports_free_pages", "settle_seconds"})


def __getattr__(name: str) -> Any:
    for names, module in ((_RUNNER, "runner"), (_CONTENDERS, "contenders"), (_MEASURE, "measure")):
        if name in names:
            return getattr(import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
