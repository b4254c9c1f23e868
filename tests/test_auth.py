"""Only you read or change your memory: every abuse a caller can try at the gateway is refused (no credential, a
wrong, revoked, expired or forged one, another tenant's user, another's query id, too many requests), and the
right credential gets through.

The gateway runs on a real embedded broker; JWTs are signed with an RSA key made here, whose public half is the
JWKS file the gateway reads (no network)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from memstream.broker import EmbeddedBroker
from memstream.cli import app as cli
from schemas.events import Answer, AnswerStatus, DeadLetter
from services.settings import Settings
from streams.codec import encode
from streams.gateway.app import create_app
from streams.gateway.auth import rate_limiter
from streams.gateway.client import bearer
from streams.gateway.keys import KeyStore, ensure_admin_key, keys_file
from streams.gateway.ratelimit import RateLimiter
from streams.topics import TopicNames
from tests.test_gateway import produce

T0 = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)
ISSUER, AUDIENCE = "https://id.example.test/", "memstream"

pytestmark = pytest.mark.server


class Issuer:
    """An OIDC issuer for tests: an RSA key pair, its JWKS file, and tokens signed with it (or not)."""

    def __init__(self, path: Path, kid: str = "k1") -> None:
        self.kid = kid
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        self.jwks = path
        path.write_text(json.dumps({"keys": [{**jwk, "kid": kid, "use": "sig", "alg": "RS256"}]}))

    def token(self, signer: Any = None, **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1", "iat": now, "exp": now + 300, **claims}
        return jwt.encode(body, signer or self.key, algorithm="RS256", headers={"kid": self.kid})


@pytest.fixture
def issuer(tmp_path: Path) -> Issuer:
    return Issuer(tmp_path / "jwks.json")


@pytest.fixture
def gateway_settings(
    data_dir: Path, issuer: Issuer, settings_factory: Callable[..., Settings]
) -> Callable[..., Settings]:
    """Test settings with the test issuer configured, and ``overrides``."""

    def make(**overrides: Any) -> Settings:
        oidc = {"oidc_issuer": ISSUER, "oidc_audience": AUDIENCE, "oidc_jwks_file": issuer.jwks}
        return settings_factory(data_dir, **oidc, **overrides)

    return make


@pytest.fixture
def settings(gateway_settings: Callable[..., Settings]) -> Settings:
    return gateway_settings()


@pytest.fixture
def gateway(broker: EmbeddedBroker, settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, broker.bootstrap)) as client:
        yield client


class Keys:
    def __init__(self, settings: Settings, make: Callable[..., str]) -> None:
        self.admin = make(settings)
        self.alice = make(settings, ["alice"], ["write", "ask", "read"])
        self.bob = make(settings, ["bob"], ["write", "ask", "read"])
        self.alice_reader = make(settings, ["alice"], ["read"])
        self.metrics = make(settings, ["*"], ["metrics"])


@pytest.fixture
def keys(settings: Settings, key_factory: Callable[..., str]) -> Keys:
    return Keys(settings, key_factory)


def message(user: str | None = "alice", text: str = "My locker code is 4711.") -> dict[str, Any]:
    body = {"speaker": "Anna", "text": text, "event_time": T0.isoformat()}
    return body if user is None else {**body, "user_id": user}


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


ROUTES = [
    ("POST", "/v1/messages"),
    ("POST", "/v1/documents"),
    ("POST", "/v1/questions"),
    ("GET", "/v1/answers/q_x"),
    ("GET", "/v1/traces/q_x"),
    ("GET", "/v1/traces/q_x/stream"),
    ("GET", "/v1/stats/alice"),
    ("GET", "/v1/graph/alice/neighbourhood?ids=o_x"),
    ("GET", "/v1/dead-letters"),
    ("POST", "/v1/dead-letters/replay"),
    ("POST", "/v1/forget"),
    ("GET", "/v1/forget/f_x"),
    ("GET", "/v1/keys"),
    ("POST", "/v1/keys"),
    ("DELETE", "/v1/keys/abc"),
    ("GET", "/v1/stages"),
    ("GET", "/metrics"),
]


def test_every_route_but_health_and_the_page_needs_a_credential(
    gateway: TestClient, keys: Keys, settings: Settings
) -> None:
    revoked = KeyStore.of(settings).create(["alice"], ["read"])
    KeyStore.of(settings).revoke(revoked[0].key_id)
    wrong_secret = keys.alice[:-4] + ("AAAA" if not keys.alice.endswith("AAAA") else "BBBB")
    refused = {
        None: 'Bearer realm="memstream"',
        f"Basic {keys.alice}": 'error="invalid_token"',
        "Bearer msk_nonsense": 'error="invalid_token"',
        f"Bearer {wrong_secret}": 'error="invalid_token"',
        f"Bearer {revoked[1]}": 'error="invalid_token"',
        "Bearer not.a.jwt": 'error="invalid_token"',
    }
    for method, path in ROUTES:
        for header, challenge in refused.items():
            headers = {"Authorization": header} if header else {}
            response = gateway.request(method, path, headers=headers, json=message())
            assert response.status_code == 401, (method, path, header, response.text)
            assert challenge in response.headers["www-authenticate"], (path, header)
            assert response.json()["detail"]
    assert gateway.get("/healthz").status_code == 200
    assert gateway.get("/").status_code == 200  # the page itself holds no data; it asks for a key
    assert gateway.get("/v1/stages", headers=bearer(keys.alice_reader)).status_code == 200


def test_another_tenants_memory_cannot_be_written_asked_or_read(gateway: TestClient, keys: Keys) -> None:
    bob = bearer(keys.bob)
    assert gateway.post("/v1/messages", json=message(), headers=bob).status_code == 403
    assert gateway.post("/v1/messages", json=[message("bob"), message("alice")], headers=bob).status_code == 403
    doc = {"user_id": "alice", "title": "note", "text": "The code is 0000."}
    assert gateway.post("/v1/documents", json=doc, headers=bob).status_code == 403
    ask = {"user_id": "alice", "question": "What is my locker code?"}
    assert gateway.post("/v1/questions", json=ask, headers=bob).status_code == 403
    assert gateway.get("/v1/stats/alice", headers=bob).status_code == 403
    neighbourhood = gateway.get("/v1/graph/alice/neighbourhood", params={"ids": "o_x"}, headers=bob)
    assert neighbourhood.status_code == 403
    assert gateway.get("/v1/dead-letters", params={"user_id": "alice"}, headers=bob).status_code == 403
    assert gateway.get("/v1/traces/q_x", params={"user_id": "alice"}, headers=bob).status_code == 403
    forget_alice = {"user_id": "alice", "scope": "user"}
    assert gateway.post("/v1/forget", json=forget_alice, headers=bob).status_code == 403
    # actions outside the key's scopes: a reader cannot write or ask, a tenant cannot replay or manage keys
    reader = bearer(keys.alice_reader)
    assert gateway.post("/v1/messages", json=message(), headers=reader).status_code == 403
    assert gateway.post("/v1/questions", json={**ask, "user_id": "alice"}, headers=reader).status_code == 403
    assert gateway.post("/v1/forget", json=forget_alice, headers=reader).status_code == 403
    assert gateway.post("/v1/dead-letters/replay", json={"all": True}, headers=bob).status_code == 403
    assert gateway.get("/v1/keys", headers=bob).status_code == 403
    assert gateway.post("/v1/keys", json={"users": ["*"], "scopes": ["admin"]}, headers=bob).status_code == 403
    assert gateway.get("/metrics", headers=bob).status_code == 403
    # the same requests for one's own user go through; a one-user key fills in the user
    assert gateway.post("/v1/messages", json=message("bob"), headers=bob).status_code == 202
    forget_id = gateway.post("/v1/forget", json={"scope": "message", "target": "m_x"}, headers=bob).json()["forget_id"]
    assert gateway.get(f"/v1/forget/{forget_id}", headers=bob).json()["user_id"] == "bob"
    # alice's key learns nothing of bob's forget, not even that the id exists: the 404 of an unknown id
    assert gateway.get(f"/v1/forget/{forget_id}", headers=reader).status_code == 404
    assert gateway.get("/v1/stats/bob", headers=bob).status_code == 200
    assert gateway.get("/v1/stats/alice", headers=reader).status_code == 200
    assert gateway.get("/v1/graph/alice/neighbourhood", params={"ids": "o_x"}, headers=reader).status_code == 200
    filled = gateway.post("/v1/messages", json=[message(None)], headers=bearer(keys.alice))
    assert filled.status_code == 202, filled.text
    assert gateway.post("/v1/questions", json={"question": "Code?"}, headers=bearer(keys.alice)).status_code == 202
    # an admin key acts for every user, but must say which
    admin = bearer(keys.admin)
    assert gateway.get("/v1/stats/alice", headers=admin).status_code == 200
    assert gateway.post("/v1/messages", json=message(None), headers=admin).status_code == 422
    assert gateway.get("/metrics", headers=bearer(keys.metrics)).status_code == 200


def test_answers_and_traces_are_only_their_users_and_query_ids_are_the_servers(
    gateway: TestClient, broker: EmbeddedBroker, settings: Settings, keys: Keys
) -> None:
    alice, bob = bearer(keys.alice), bearer(keys.bob)
    chosen = {"user_id": "alice", "question": "What is my locker code?", "event_id": "q1"}
    refused = gateway.post("/v1/questions", json=chosen, headers=alice)
    assert refused.status_code == 422 and "made by the server" in refused.json()["detail"]
    query_id = gateway.post("/v1/questions", json={"question": "What is my locker code?"}, headers=alice).json()[
        "query_id"
    ]
    other = gateway.post("/v1/questions", json={"question": "What is my locker code?"}, headers=bob).json()["query_id"]
    assert query_id != other and len(query_id) >= 32  # unguessable, and never the same id for two users
    answer = Answer(
        event_id=f"ans_{query_id}",
        user_id="alice",
        event_time=T0,
        query_id=query_id,
        trace_id=f"tr_{query_id}",
        question="What is my locker code?",
        answer="4711",
        status=AnswerStatus.ANSWERED,
    )
    asyncio.run(produce(broker.bootstrap, TopicNames.from_settings(settings).answers, encode(answer), b"alice"))
    assert gateway.get(f"/v1/answers/{query_id}", params={"wait": 10}, headers=alice).json()["answer"] == "4711"
    wait_until(lambda: gateway.get(f"/v1/traces/{query_id}", headers=alice).status_code == 200, "alice's trace")
    # bob knows the id: he still sees neither the answer nor the trace nor its stream
    assert gateway.get(f"/v1/answers/{query_id}", headers=bob).status_code == 404
    assert gateway.get(f"/v1/traces/{query_id}", headers=bob).status_code == 404
    with gateway.stream("GET", f"/v1/traces/{query_id}/stream", headers=bob) as stream:
        text = stream.read().decode()
    # the answer is not in it (a random query id can itself hold the digits 4711: one did, on 5 December)
    assert "event: unavailable" in text and "4711" not in text.replace(query_id, "")
    with gateway.stream("GET", f"/v1/traces/{query_id}/stream", headers=alice) as stream:
        text = stream.read().decode()
    assert "event: end" in text and "4711" in text
    assert gateway.get(f"/v1/answers/{query_id}", headers=bearer(keys.admin)).status_code == 200


def test_dead_letters_list_only_the_callers_users(
    gateway: TestClient, broker: EmbeddedBroker, settings: Settings, keys: Keys
) -> None:
    topic = TopicNames.from_settings(settings).dead_letters
    for user in ("alice", "bob"):
        letter = DeadLetter(
            event_id=f"dl_{user}",
            user_id=user,
            source_topic="memstream.chat",
            reason="extraction_failed",
            error="no",
            payload="{}",
            failed_event_ids=[f"m_{user}"],
            attempts=3,
            ingest_time=T0,
        )
        asyncio.run(produce(broker.bootstrap, topic, encode(letter), user.encode()))
    admin = bearer(keys.admin)
    wait_until(lambda: gateway.get("/v1/dead-letters", headers=admin).json()["total"] == 2, "both dead letters")
    page = gateway.get("/v1/dead-letters", params={"include_payload": True}, headers=bearer(keys.bob)).json()
    assert [d["user_id"] for d in page["dead_letters"]] == ["bob"]


def test_tokens_are_verified_issuer_audience_expiry_and_signature(gateway: TestClient, issuer: Issuer) -> None:
    def stats(token: str, user: str = "alice") -> int:
        return gateway.get(f"/v1/stats/{user}", headers=bearer(token)).status_code

    good = issuer.token(memstream_users=["alice"], scope="read ask")
    assert stats(good) == 200
    assert stats(good, "bob") == 403
    assert stats(issuer.token(sub="alice", scope="read")) == 200  # no users claim: the subject is the user
    assert stats(issuer.token(memstream_users=["alice"], scope="write")) == 403  # not the read scope
    now = int(time.time())
    assert stats(issuer.token(memstream_users=["alice"], scope="read", exp=now - 120, iat=now - 400)) == 401
    assert stats(issuer.token(memstream_users=["alice"], scope="read", aud="someone-else")) == 401
    assert stats(issuer.token(memstream_users=["alice"], scope="read", iss="https://evil.test/")) == 401
    forger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert stats(issuer.token(forger, memstream_users=["alice"], scope="read")) == 401
    unsigned = jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 60, "scope": "read"}, None, "none")
    assert stats(unsigned) == 401
    hs = jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": now + 60}, "k" * 32, algorithm="HS256")
    assert stats(hs) == 401
    response = gateway.get("/v1/stats/alice", headers=bearer(issuer.token(aud="x", scope="read")))
    assert 'error="invalid_token"' in response.headers["www-authenticate"]


def test_keys_are_made_listed_and_revoked_by_an_admin_and_stored_hashed(
    gateway: TestClient, keys: Keys, settings: Settings
) -> None:
    admin = bearer(keys.admin)
    made = gateway.post("/v1/keys", json={"users": ["carol"], "scopes": ["read"], "label": "carol"}, headers=admin)
    assert made.status_code == 201, made.text
    key, key_id = made.json()["key"], made.json()["key_id"]
    assert gateway.get("/v1/stats/carol", headers=bearer(key)).status_code == 200
    listed = gateway.get("/v1/keys", headers=admin).json()["keys"]
    assert key_id in [k["key_id"] for k in listed] and all("hash" not in k and "key" not in k for k in listed)
    stored = keys_file(settings).read_text()
    secrets = [k.split("_", 2)[2] for k in (key, keys.admin)]  # msk_<id>_<secret>; a secret may hold "_" itself
    assert key_id in stored and not any(secret in stored for secret in secrets)
    bad = gateway.post("/v1/keys", json={"users": ["carol"], "scopes": ["superuser"]}, headers=admin)
    assert bad.status_code == 422
    assert gateway.delete(f"/v1/keys/{key_id}", headers=admin).status_code == 200
    assert gateway.get("/v1/stats/carol", headers=bearer(key)).status_code == 401
    assert gateway.delete("/v1/keys/0000000000000000", headers=admin).status_code == 404


def test_the_cli_manages_keys_and_a_first_start_makes_one_admin_key(settings: Settings, monkeypatch: Any) -> None:
    first = ensure_admin_key(settings)
    assert first is not None and first.startswith("msk_")
    assert ensure_admin_key(settings) is None  # only on a first start
    assert KeyStore.of(settings).verify(first) is not None
    monkeypatch.setenv("MEMSTREAM_DATA_DIR", str(settings.data_dir))
    runner = CliRunner()
    created = runner.invoke(cli, ["keys", "create", "--local", "--user", "dan", "--scope", "read,ask"])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip().splitlines()[-1]
    record = KeyStore.of(settings).verify(key)
    assert record is not None and record.users == ["dan"] and record.scopes == ["ask", "read"]
    listed = runner.invoke(cli, ["keys", "list", "--local", "--json"])
    assert record.key_id in listed.stdout and key not in listed.stdout
    assert runner.invoke(cli, ["keys", "revoke", "--local", record.key_id]).exit_code == 0
    assert KeyStore.of(settings).verify(key) is None
    assert runner.invoke(cli, ["keys", "create", "--local", "--user", "dan", "--scope", "root"]).exit_code == 1


def test_writes_and_questions_are_rate_limited_per_credential(
    broker: EmbeddedBroker,
    gateway_settings: Callable[..., Settings],
    key_factory: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the buckets' clock stands still: on a loaded machine (a model beside the suite) the requests below took long
    # enough for the bucket to refill a token between them, and the third question passed
    from streams.gateway import app as gateway_app

    def still(settings: Settings) -> RateLimiter:
        limiter = rate_limiter(settings)
        limiter.clock = lambda: 0.0
        return limiter

    monkeypatch.setattr(gateway_app, "rate_limiter", still)
    settings = gateway_settings(rate_questions_per_min=2, rate_writes_per_min=3)
    alice, bob = key_factory(settings, ["alice"], ["ask", "write"]), key_factory(settings, ["bob"], ["ask", "write"])
    with TestClient(create_app(settings, broker.bootstrap)) as gateway:
        ask = {"question": "Where do I work?"}
        statuses = [gateway.post("/v1/questions", json=ask, headers=bearer(alice)).status_code for _ in range(3)]
        assert statuses == [202, 202, 429]
        refused = gateway.post("/v1/questions", json=ask, headers=bearer(alice))
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert gateway.post("/v1/questions", json=ask, headers=bearer(bob)).status_code == 202  # bob's own bucket
        batch = [message(None, f"fact {n}") for n in range(5)]  # a batch may overdraw the bucket once
        assert gateway.post("/v1/messages", json=batch, headers=bearer(alice)).status_code == 202
        assert gateway.post("/v1/messages", json=batch[:1], headers=bearer(alice)).status_code == 429


def test_the_token_bucket_refills_and_says_when() -> None:
    now = [0.0]
    limiter = RateLimiter({"question": 60}, clock=lambda: now[0])  # one a second, a minute's worth at once
    for _ in range(60):
        limiter.take("k", "question")
    with pytest.raises(Exception) as refused:
        limiter.take("k", "question")
    assert refused.value.headers == {"Retry-After": "1"}  # type: ignore[attr-defined]
    now[0] += 1.0
    limiter.take("k", "question")
    limiter.take("other", "question")
    RateLimiter({"question": 0}).take("k", "question", 10**6)  # 0: no limit


def test_metrics_can_be_made_public(broker: EmbeddedBroker, gateway_settings: Callable[..., Settings]) -> None:
    settings = gateway_settings(metrics_public=True)
    with TestClient(create_app(settings, broker.bootstrap)) as gateway:
        assert gateway.get("/metrics").status_code == 200
        assert gateway.get("/v1/stats/alice").status_code == 401


def test_the_demo_uses_the_first_admin_key_or_a_key_of_its_own_that_it_revokes(
    settings: Settings, monkeypatch: Any
) -> None:
    from memstream.cli import _demo_key

    monkeypatch.delenv("MEMSTREAM_API_KEY", raising=False)
    admin = ensure_admin_key(settings)
    with _demo_key(settings, admin) as key:
        assert key == admin
    with _demo_key(settings, None) as key:  # a later start: the admin key is not known any more
        record = KeyStore.of(settings).verify(key)
        assert record is not None and record.users == ["demo"] and "admin" not in record.scopes
    assert KeyStore.of(settings).verify(key) is None  # revoked once the demo is done
