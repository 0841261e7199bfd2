"""The lab and the benchmarks that ``sluice bench`` and ``sluice demo`` run.

Scenarios run real worker processes against a real Redis and compute every
figure from what the handlers recorded, never from the engine's own
counters; results go to the terminal (rich tables), JSON and an HTML report.
Needs the ``lab`` extra.
"""

from sluice.extras import require

require("lab", "the lab and the benchmarks", "psutil", "httpx", "starlette", "uvicorn")
