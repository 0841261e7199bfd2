"""The PostgreSQL system of record: job records, attempts, idempotency, the ledger's copy.

Empty until the store lands: SQLAlchemy 2 (async, asyncpg) models and
Alembic migrations. It may import ``local`` and ``engine`` and knows
nothing of HTTP or LLM providers. Needs the ``service`` extra.
"""
