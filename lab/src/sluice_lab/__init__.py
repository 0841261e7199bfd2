"""The lab and the benchmarks of Sluice: ``sluice bench ...`` (the sluice-lab distribution).

Scenarios run real worker processes against a real Redis and compute every
figure from what the handlers recorded, never from the engine's own
counters; results go to the terminal (rich tables), JSON and an HTML report.
The commands are :mod:`sluice_lab.cli`, which the ``sluice`` command line
finds through the ``sluice.commands`` entry point group.
"""

from sluice_lab.deps import require

require("the lab and the benchmarks", "psutil", "httpx", "starlette", "uvicorn")
