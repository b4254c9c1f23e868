"""The gateway never answers 5xx to client input: hypothesis throws random bytes, random and deep JSON, lone
surrogates, odd content types and valid bodies with one mutated field at every route (over a real embedded
broker), and a real uvicorn server keeps its keep-alive connection through the inputs that used to drop it."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_poison import FAR_FUTURE, JSON_VALUES, deep

from memstream.broker import EmbeddedBroker, free_port
from schemas.validation import MAX_JSON_DEPTH
from services.settings import Settings
from streams.gateway.app import create_app
from streams.gateway.client import bearer

pytestmark = pytest.mark.server

FUZZ = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BODY_LIMIT = 256 * 1024
VALID: dict[str, dict[str, Any]] = {
    "/v1/messages": {
        "user_id": "fuzz",
        "speaker": "Anna",
        "text": "I work at Siemens.",
        "event_time": "2024-03-02T10:00:00Z",
    },
    "/v1/documents": {"user_id": "fuzz", "title": "CV", "text": "Anna: nurse since 2024."},
    "/v1/questions": {"user_id": "fuzz", "question": "Where does Anna work?"},
    "/v1/dead-letters/replay": {"all": True, "user_id": "fuzz"},
}
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    "application/vnd.memstream+json",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
]
BAD_VALUES = st.sampled_from(
    ["\ud800", "x\udfffy", "\x00", "Anna\n", FAR_FUTURE, "1899-01-01T00:00:00Z", "", "a" * 30_000]
)


@pytest.fixture(scope="module")
def gateway_settings(tmp_path_factory: pytest.TempPathFactory, settings_factory: Any) -> Settings:
    settings: Settings = settings_factory(tmp_path_factory.mktemp("fuzz"), max_body_bytes=BODY_LIMIT)
    return settings


@pytest.fixture(scope="module")
def admin(gateway_settings: Settings, key_factory: Any) -> dict[str, str]:
    """The Authorization header of an admin key: the fuzzing is of the input, not of the credential."""
    return bearer(key_factory(gateway_settings))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    instance = EmbeddedBroker(tmp_path_factory.mktemp("fuzz-broker"))
    asyncio.run(instance.start())
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="module")
def client(broker: EmbeddedBroker, gateway_settings: Settings, admin: dict[str, str]) -> Iterator[TestClient]:
    app = create_app(gateway_settings, broker.bootstrap)
    with TestClient(app, headers=admin) as test_client:
        deadline = time.monotonic() + 20
        while not test_client.get("/v1/dead-letters").json()["complete"]:  # until then replay answers 503
            assert time.monotonic() < deadline, "the dead-letter feed never caught up"
            time.sleep(0.05)
        yield test_client


@st.composite
def bodies(draw: st.DrawFn, path: str) -> tuple[bytes, bool]:
    """A request body, and whether it is valid JSON of a valid request (then it must be accepted)."""
    kind = draw(st.sampled_from(["bytes", "json", "deep", "valid", "mutated", "bad_value", "huge"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300)), False
    if kind == "json":
        return json.dumps(draw(JSON_VALUES)).encode(), False
    if kind == "deep":
        return deep(draw(st.integers(MAX_JSON_DEPTH + 1, 100_000))), False
    if kind == "huge":
        return b'{"text": "' + b"a" * BODY_LIMIT + b'"}', False
    item = dict(VALID[path])
    if kind == "valid":
        return json.dumps(item).encode(), True
    field = draw(st.sampled_from([*item, "event_time", "event_id", "speaker", "as_of", "unknown"]))
    item[field] = draw(BAD_VALUES if kind == "bad_value" else JSON_VALUES)
    return json.dumps(item).encode(), False


ROUTES_AND_BODIES = st.sampled_from(sorted(VALID)).flatmap(lambda p: st.tuples(st.just(p), bodies(p)))


def check(response: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert response.json()["detail"], response.text[:500]  # a clear message, as JSON


@FUZZ
@given(
    st.sampled_from(sorted(VALID)).flatmap(lambda p: st.tuples(st.just(p), bodies(p))), st.sampled_from(CONTENT_TYPES)
)
def test_posted_bodies_never_get_a_5xx(
    client: TestClient, drawn: tuple[str, tuple[bytes, bool]], ctype: str | None
) -> None:
    path, (body, valid) = drawn
    headers = {} if ctype is None else {"content-type": ctype}
    response = client.post(path, content=body, headers=headers)
    check(response)
    if valid and ctype in (None, "application/json", "application/json; charset=utf-8"):
        assert response.status_code == 202, response.text  # the limits never refuse a valid request


SEGMENTS = st.text(max_size=40) | st.sampled_from(["..", "%00", "a" * 5000, "fuzz", "q_1"])
PARAM_VALUES = st.text(max_size=20) | st.sampled_from(["nan", "inf", "-1", "1e309", "31", "0", "true", "dead"])


@st.composite
def get_requests(draw: st.DrawFn) -> str:
    route = draw(
        st.sampled_from(
            [
                "/v1/answers/{}",
                "/v1/stats/{}",
                "/v1/traces/{}",
                "/v1/graph/{}/neighbourhood",
                "/v1/dead-letters",
                "/v1/stages",
                "/metrics",
                "/",
            ]
        )
    )
    path = route.format(quote(draw(SEGMENTS), safe=""))
    names = st.sampled_from(["wait", "user_id", "ids", "per_vertex", "reason", "status", "limit", "offset", "x"])
    params = draw(st.lists(st.tuples(names, PARAM_VALUES), max_size=4))
    # a long poll is a wait, not a failure: keep fuzzed waits short
    params = [(k, v) for k, v in params if not (k == "wait" and _seconds(v) > 0.05)]
    return f"{path}?{urlencode(params)}" if params else path


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


@FUZZ
@given(get_requests())
def test_every_get_route_never_gets_a_5xx(client: TestClient, url: str) -> None:
    check(client.get(url))


# -- a real server: no 500, no dropped keep-alive connection ------------------------------------------------------


@pytest.fixture(scope="module")
def server(broker: EmbeddedBroker, gateway_settings: Settings) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(
        create_app(gateway_settings, broker.bootstrap), host="127.0.0.1", port=port, log_config=None, lifespan="on"
    )
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, name="fuzz-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not instance.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        instance.should_exit = True
        thread.join(timeout=15)


KEEP_ALIVE_CASES: list[tuple[str, bytes, str | None, int]] = [
    ("/v1/messages", deep(5_000), "application/json", 422),
    ("/v1/messages", deep(100_000), "application/json", 422),
    ("/v1/messages", json.dumps(VALID["/v1/messages"] | {"text": "\ud800"}).encode(), "application/json", 422),
    ("/v1/messages", json.dumps(VALID["/v1/messages"] | {"speaker": "\ud800"}).encode(), "application/json", 422),
    ("/v1/messages", json.dumps(VALID["/v1/messages"] | {"user_id": "\ud800"}).encode(), "application/json", 422),
    ("/v1/messages", json.dumps(VALID["/v1/messages"] | {"event_time": FAR_FUTURE}).encode(), None, 422),
    ("/v1/documents", '{"text": "é"}'.encode("latin-1"), "application/json", 422),  # not UTF-8
    ("/v1/documents", "{}".encode("utf-16"), "application/json", 422),
    ("/v1/questions", b'{"user_id": "fuzz", "question": "?"}', "text/plain", 415),
    ("/v1/questions", b'{"user_id": "fuzz", "question": "?"}', "application/json; charset=latin-1", 415),
    ("/v1/dead-letters/replay", deep(10_000), "application/json", 422),
    ("/v1/messages", json.dumps(VALID["/v1/messages"]).encode(), "application/json", 202),
]


def test_a_real_server_answers_4xx_and_keeps_the_connection(server: str, admin: dict[str, str]) -> None:
    connection = http.client.HTTPConnection(server, timeout=30)
    try:
        connection.connect()
        sock = connection.sock
        for path, body, ctype, expected in KEEP_ALIVE_CASES:
            headers = ({"content-type": ctype} if ctype else {}) | admin
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            text = response.read()
            assert response.status == expected, (path, body[:80], response.status, text[:300])
            assert json.loads(text)["detail" if expected >= 400 else "accepted"]
            assert not response.will_close and connection.sock is sock, f"connection dropped after {body[:80]!r}"
    finally:
        connection.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_gets_413_declared_or_not(server: str, chunked: bool, admin: dict[str, str]) -> None:
    connection = http.client.HTTPConnection(server, timeout=30)
    chunks = [b"x" * 65536] * (BODY_LIMIT // 65536 + 1)
    body: Any = iter(chunks) if chunked else b"".join(chunks)
    try:
        headers = {"content-type": "application/json"} | admin
        connection.request("POST", "/v1/messages", body=body, headers=headers, encode_chunked=chunked)
        response = connection.getresponse()
        assert response.status == 413
        assert "MEMSTREAM_MAX_BODY_BYTES" in json.loads(response.read())["detail"]
    finally:
        connection.close()
