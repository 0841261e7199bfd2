"""The HTTP service (``sluice serve``): FastAPI routes in front of the engine and the store.

Empty until the service lands: this package holds the API routes (ours under
``/v1`` and the reference designs' compatibility routes), authentication,
request schemas and the dashboard. It may import ``llm``, ``store``,
``local`` and ``engine``; only ``cli`` imports it. Needs the ``service`` extra.
"""
