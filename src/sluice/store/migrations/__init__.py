"""Alembic migrations of the store (run by :func:`sluice.store.database.migrate`)."""
