"""API keys, kept as salted scrypt hashes in one JSON file (``MEMSTREAM_AUTH_KEYS_FILE``, by default
``<data_dir>/auth/api-keys.json``).

A key reads ``msk_<key id>_<secret>``: the key id finds the record, the secret is checked against its hash in
constant time. Only the hash is stored; the whole key is shown once, when it is made. The file is re-read when it
changes, so a key made or revoked by another process (``memstream keys ...``) counts at the next request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field

from services.settings import Settings

KEY_PREFIX = "msk_"
_KEY = re.compile(r"^msk_([0-9a-f]{16})_([A-Za-z0-9_-]{32,128})$")
# scrypt at 16 MiB, ~60 ms a check on 2 busy cores: the secrets are random (no dictionary to try), the cost only
# slows a thief of the file; a verified key is remembered in memory, so a client pays it once per gateway process
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "maxmem": 64 * 2**20, "dklen": 32}

SCOPES = ("write", "ask", "read", "metrics", "admin")


class KeyRequestError(ValueError):
    """A key request that cannot be met (unknown key id, bad scope or user)."""


class ApiKey(BaseModel):
    key_id: str
    users: list[str] = Field(description='the users (tenant) the key acts for; "*" for all')
    scopes: list[str]
    label: str = ""
    created_at: datetime
    revoked_at: datetime | None = None
    salt: str = Field(description="hex")
    hash: str = Field(description="hex scrypt of the secret")

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def public(self) -> dict[str, object]:
        """What may be shown: everything but the salt and the hash."""
        return self.model_dump(mode="json", exclude={"salt", "hash"})


class _File(BaseModel):
    keys: list[ApiKey] = []
    #: "<platform>:<workspace or chat>" -> the memstream user its messages belong to (connectors)
    places: dict[str, str] = {}


def keys_file(settings: Settings) -> Path:
    return settings.auth_keys_file or settings.data_dir / "auth" / "api-keys.json"


def _hash(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, **_SCRYPT)


def check_scopes_and_users(users: Sequence[str], scopes: Sequence[str]) -> None:
    from streams.gateway.inputs import InvalidInput, check_user_id

    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise KeyRequestError(f"scopes must be some of {', '.join(SCOPES)}; got {', '.join(scopes) or 'none'}")
    if not users:
        raise KeyRequestError('a key acts for at least one user ("*" for all)')
    for user in users:
        if user != "*":
            try:
                check_user_id(user)
            except InvalidInput as exc:
                raise KeyRequestError(str(exc)) from exc


class KeyStore:
    """The key file: made, listed and revoked under a file lock; read again whenever it changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._keys: dict[str, ApiKey] = {}
        self._places: dict[str, str] = {}
        self._verified: dict[bytes, str] = {}  # sha256 of a key that passed scrypt -> its key id

    @classmethod
    def of(cls, settings: Settings) -> KeyStore:
        return cls(keys_file(settings))

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

    def keys(self) -> dict[str, ApiKey]:
        """key id -> key, as the file holds them now."""
        stamp = self._stamp()
        if stamp != self._seen:
            content = self._read()
            self._keys = {k.key_id: k for k in content.keys}
            self._places = dict(content.places)
            self._verified.clear()  # a revoked key must not stay verified
            self._seen = stamp
        return self._keys

    def _read(self) -> _File:
        try:
            return _File.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return _File()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[_File]:
        """The file's content, written back (atomically, mode 600) when the block ends without error."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            content = self._read()
            yield content
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(content.model_dump_json(indent=2))
            os.replace(tmp, self.path)

    def create(self, users: Sequence[str], scopes: Sequence[str], label: str = "") -> tuple[ApiKey, str]:
        """A new key: its record and the whole key (``msk_...``), which is not kept anywhere."""
        check_scopes_and_users(users, scopes)
        key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_bytes(16)
        record = ApiKey(
            key_id=key_id,
            users=sorted(set(users)),
            scopes=[s for s in SCOPES if s in scopes],
            label=label,
            created_at=datetime.now(UTC),
            salt=salt.hex(),
            hash=_hash(secret, salt).hex(),
        )
        with self._locked() as content:
            content.keys.append(record)
        return record, f"{KEY_PREFIX}{key_id}_{secret}"

    def revoke(self, key_id: str) -> ApiKey:
        with self._locked() as content:
            for record in content.keys:
                if record.key_id == key_id:
                    record.revoked_at = record.revoked_at or datetime.now(UTC)
                    return record
        raise KeyRequestError(f"no key {key_id!r}")

    def places(self) -> dict[str, str]:
        """Connector places (``slack:T0123``, ``telegram:-1001234``) -> user, as the file holds them now."""
        self.keys()  # re-reads the file when it changed
        return self._places

    def place_user(self, platform: str, place: str) -> str | None:
        return self.places().get(f"{platform}:{place}")

    def map_place(self, platform: str, place: str, user_id: str | None) -> None:
        """Map a workspace or chat to a user (None: unmap it)."""
        with self._locked() as content:
            if user_id is None:
                content.places.pop(f"{platform}:{place}", None)
            else:
                content.places[f"{platform}:{place}"] = user_id

    def verify(self, presented: str) -> ApiKey | None:
        """The active key ``presented`` is, or None (unknown id, wrong secret, revoked)."""
        match = _KEY.match(presented)
        if match is None:
            return None
        key_id, secret = match.groups()
        record = self.keys().get(key_id)
        if record is None or not record.active:
            return None
        fingerprint = hashlib.sha256(presented.encode()).digest()
        if self._verified.get(fingerprint) == key_id:
            return record
        if not hmac.compare_digest(_hash(secret, bytes.fromhex(record.salt)), bytes.fromhex(record.hash)):
            return None
        self._verified[fingerprint] = key_id
        return record


def ensure_admin_key(settings: Settings) -> str | None:
    """On a first start (no key file, or no active key in it): make an admin key and return it, else None."""
    store = KeyStore.of(settings)
    if any(k.active for k in store.keys().values()):
        return None
    _, key = store.create(["*"], ["admin"], label="admin (made by the first `memstream up`)")
    return key


def create_key(settings: Settings, users: Sequence[str], scopes: Sequence[str], label: str = "") -> str:
    """A new key in the settings' key file (tests, benchmarks, ``memstream keys create --local``)."""
    return KeyStore.of(settings).create(users, scopes, label)[1]
