"""API keys: made, looked up and revoked. A key is shown once, when it is made.

A key is ``sk_`` and 43 URL-safe characters (256 random bits). The store
keeps its SHA-256 and its first characters; a lookup hashes what the caller
sent and finds the row by that digest, so a key never has to be compared in
the clear, and a stolen table yields no key.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sqlalchemy import select, update

from sluice.errors import ConfigurationError
from sluice.store.schema import ApiKeyRow

if TYPE_CHECKING:
    from sluice.store.database import Database

KEY_PREFIX = "sk_"
_TENANT = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: uuid.UUID
    tenant: str
    admin: bool
    name: str | None
    prefix: str
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, row: ApiKeyRow) -> ApiKey:
        return cls(row.id, row.tenant, row.admin, row.name, row.prefix, row.created_at, row.revoked_at)


class KeyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(
        self, tenant: str, *, admin: bool = False, name: str | None = None
    ) -> tuple[ApiKey, str]:
        """A new key for ``tenant``; returns its record and the key itself (shown once)."""
        if not _TENANT.match(tenant):
            raise ConfigurationError(
                f"tenant {tenant!r} is not usable: use 1-100 characters from A-Z a-z 0-9 _ . : -"
            )
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        row = ApiKeyRow(
            id=uuid.uuid4(),
            tenant=tenant,
            admin=admin,
            name=name,
            prefix=key[:10],
            digest=digest(key),
            created_at=datetime.now(UTC),
        )
        async with self.db.sessions() as session, session.begin():
            session.add(row)
        return ApiKey.of(row), key

    async def lookup(self, key: str) -> ApiKey | None:
        """The live key a caller sent, or None (unknown or revoked)."""
        if not key.startswith(KEY_PREFIX) or len(key) > 200:
            return None
        async with self.db.sessions() as session:
            row = await session.scalar(
                select(ApiKeyRow).where(ApiKeyRow.digest == digest(key), ApiKeyRow.revoked_at.is_(None))
            )
        return ApiKey.of(row) if row is not None else None

    async def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        query = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
        if tenant is not None:
            query = query.where(ApiKeyRow.tenant == tenant)
        async with self.db.sessions() as session:
            return [ApiKey.of(r) for r in await session.scalars(query)]

    async def revoke(self, key_id: uuid.UUID) -> bool:
        """Revoke a key; False if there is no such live key."""
        async with self.db.sessions() as session, session.begin():
            done = await session.execute(
                update(ApiKeyRow)
                .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
                .values(revoked_at=datetime.now(UTC))
            )
        return bool(done.rowcount)  # type: ignore[attr-defined]
