"""Transport security on the real servers: Kafka with SASL/SCRAM-SHA-256, Dgraph with ACL and an admin token,
Weaviate with an API key, as ``MEMSTREAM_STACK_SECURE=1 scripts/stack up`` starts them.

This suite starts its own secured Kafka, Dgraph and Weaviate (``scripts/stack`` in a state folder of its own, on
free ports) from the builds the usual stack uses, so it runs wherever that stack runs: it skips here and fails in
CI when the usual stack is not up. Each server must refuse a client without credentials (or with wrong ones) and
serve one with them; then memstream's own clients, configured only through settings and a secrets folder, work.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pydgraph
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from conftest import require_env  # tests/integration is on sys.path (rootdir conftest, prepend import mode)
from pydantic import SecretStr

from memstream.broker import wait_for_kafka
from services import ids
from services.adapters.dgraph import DgraphGraphStore
from services.adapters.remote import RemoteMemoryStore
from services.adapters.weaviate import WeaviateVectorStore
from services.domain import ChangeSet, Vertex, VertexKind
from services.ports import VectorItem
from services.settings import Settings
from streams.background import tail_consumer
from streams.kafka_security import kafka_client_options
from streams.topics import TopicNames, ensure_topics

pytestmark = [pytest.mark.server, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DIM = 8
PREFIX = "MemstreamSecure"
STARTUP_S = 300


#: one call's deadline: generous, since a schema change on a busy 2-core CI machine took over 10 s; the tests are
#: about what each server refuses and accepts, not how fast
CALL_S = 120


def parse_exports(text: str) -> dict[str, str]:
    """The ``export NAME=value`` lines that ``scripts/stack up`` prints, as a dict."""
    found = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            found[name] = value
    return found


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A secured Kafka, Dgraph and Weaviate of this module's own; the settings they print, by variable name."""
    require_env("MEMSTREAM_BROKER", "MEMSTREAM_DGRAPH", "MEMSTREAM_WEAVIATE_HTTP")  # the builds are there
    state = tmp_path_factory.mktemp("secure-stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMSTREAM_STACK")}
    env.update(MEMSTREAM_STACK_SECURE="1", MEMSTREAM_STACK_STATE=str(state))
    stack = [str(ROOT / "scripts" / "stack")]
    try:
        up = subprocess.run(
            [*stack, "up", "kafka", "dgraph", "weaviate"],
            env=env,
            capture_output=True,
            text=True,
            timeout=STARTUP_S,
            check=False,
        )
        assert up.returncode == 0, f"secured stack did not start:\n{up.stderr[-3000:]}"
        yield parse_exports(up.stdout)
    finally:
        subprocess.run([*stack, "down"], env=env, capture_output=True, timeout=120, check=False)


@pytest.fixture
def settings(secured: dict[str, str], tmp_path: Path) -> Settings:
    """memstream's settings for the secured stack: what the stack printed, the secrets read from its folder."""
    return Settings(
        _env_file=None,
        data_dir=tmp_path,
        broker=secured["MEMSTREAM_BROKER"],
        topic_prefix=f"secure-{uuid.uuid4().hex[:8]}",
        store="remote",
        dgraph=secured["MEMSTREAM_DGRAPH"],
        weaviate_http=secured["MEMSTREAM_WEAVIATE_HTTP"],
        weaviate_grpc=secured["MEMSTREAM_WEAVIATE_GRPC"],
        weaviate_prefix=PREFIX,
        kafka_security_protocol=secured["MEMSTREAM_KAFKA_SECURITY_PROTOCOL"],
        kafka_sasl_mechanism=secured["MEMSTREAM_KAFKA_SASL_MECHANISM"],
        kafka_username=secured["MEMSTREAM_KAFKA_USERNAME"],
        dgraph_user=secured["MEMSTREAM_DGRAPH_USER"],
        _secrets_dir=secured["MEMSTREAM_SECRETS_DIR"],
    )


def test_the_printed_settings_carry_no_secret(secured: dict[str, str]) -> None:
    folder = Path(secured["MEMSTREAM_SECRETS_DIR"])
    assert folder.stat().st_mode & 0o077 == 0
    secrets = {path.name: path.read_text() for path in folder.iterdir()}
    assert {"memstream_kafka_password", "memstream_dgraph_password", "memstream_weaviate_api_key"} <= set(secrets)
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o077 == 0, path
    printed = "\n".join(f"{k}={v}" for k, v in secured.items())
    assert not [name for name, value in secrets.items() if value in printed]


def test_settings_read_the_secrets_from_the_folder(settings: Settings, secured: dict[str, str]) -> None:
    folder = Path(secured["MEMSTREAM_SECRETS_DIR"])
    assert settings.kafka_password is not None and settings.weaviate_api_key is not None
    assert settings.kafka_password.get_secret_value() == (folder / "memstream_kafka_password").read_text()
    assert settings.dgraph_token is not None and settings.dgraph_password is not None
    assert settings.weaviate_api_key.get_secret_value() not in repr(settings)


# -- Kafka: SASL_PLAINTEXT with SCRAM-SHA-256 ---------------------------------------------------------------------


async def start_producer(bootstrap: str, **options: object) -> AIOKafkaProducer:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=5000, **options)
    try:
        await asyncio.wait_for(producer.start(), 60)
    except BaseException:
        await producer.stop()
        raise
    return producer


async def test_kafka_refuses_a_client_without_credentials(settings: Settings) -> None:
    assert settings.broker
    with pytest.raises(KafkaError):
        await start_producer(settings.broker)


async def test_kafka_refuses_a_wrong_password(settings: Settings) -> None:
    assert settings.broker
    wrong = settings.model_copy(update={"kafka_password": SecretStr("not-the-password")})
    with pytest.raises(KafkaError):
        await start_producer(settings.broker, **kafka_client_options(wrong))


async def test_kafka_produce_and_consume_with_credentials(settings: Settings) -> None:
    assert settings.broker
    topic = f"{settings.topic_prefix}.probe"
    producer = await start_producer(settings.broker, acks="all", **kafka_client_options(settings))
    try:
        await producer.send_and_wait(topic, b"hello", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=settings.broker,
        auto_offset_reset="earliest",
        group_id=f"g-{uuid.uuid4().hex[:6]}",  # a consumer group: group coordination over SASL too
        **kafka_client_options(settings),
    )
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), 60)
        assert (record.key, record.value) == (b"k", b"hello")
    finally:
        await consumer.stop()


# -- Dgraph: ACL login, and the admin token for schema changes ----------------------------------------------------


async def dgraph_client(address: str) -> tuple[pydgraph.AsyncDgraphClientStub, pydgraph.AsyncDgraphClient]:
    stub = pydgraph.AsyncDgraphClientStub(address)
    return stub, pydgraph.AsyncDgraphClient(stub)


async def test_dgraph_refuses_queries_and_alter_without_login(settings: Settings) -> None:
    assert settings.dgraph
    stub, client = await dgraph_client(settings.dgraph)
    try:
        with pytest.raises(Exception, match=r"(?i)jwt|token|unauthenticated|permission"):
            await client.txn(read_only=True).query("{ q(func: has(vertex.id), first: 1) { uid } }", timeout=CALL_S)
        with pytest.raises(Exception, match=r"(?i)jwt|token|unauthenticated|permission"):
            await client.alter(pydgraph.Operation(schema="probe.name: string ."), timeout=CALL_S)
    finally:
        await stub.close()


async def test_dgraph_refuses_a_wrong_password(settings: Settings) -> None:
    assert settings.dgraph and settings.dgraph_user
    with pytest.raises(Exception, match=r"(?i)password|credentials|unauthenticated|invalid"):
        await DgraphGraphStore.open(
            settings.dgraph,
            user=settings.dgraph_user,
            password="not-the-password",
            token=settings.dgraph_token,
            attempts=1,
            outage_s=5,
        )


async def test_dgraph_login_and_alter_need_the_admin_token(settings: Settings) -> None:
    assert settings.dgraph and settings.dgraph_user and settings.dgraph_password and settings.dgraph_token
    user, password = settings.dgraph_user, settings.dgraph_password.get_secret_value()
    token = [("auth-token", settings.dgraph_token.get_secret_value())]
    stub, client = await dgraph_client(settings.dgraph)
    try:
        with pytest.raises(Exception, match="Auth Token"):
            await client.login(user, password, timeout=CALL_S)
        await client.login(user, password, timeout=CALL_S, metadata=token)
        response = await client.txn(read_only=True).query("{ q(func: has(vertex.id), first: 1) { uid } }")
        assert json.loads(response.json) == {"q": []}
        operation = pydgraph.Operation(schema="probe.name: string .")
        with pytest.raises(Exception, match="Auth Token"):
            await client.alter(operation, timeout=CALL_S)
        await client.alter(operation, timeout=CALL_S, metadata=token)
    finally:
        await stub.close()


# -- Weaviate: API key ---------------------------------------------------------------------------------------------


def test_weaviate_answers_401_without_the_key(settings: Settings) -> None:
    assert settings.weaviate_api_key is not None
    url = f"http://{settings.weaviate_http}/v1/schema"
    assert httpx.get(url, timeout=CALL_S).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=CALL_S).status_code == 401
    key = settings.weaviate_api_key.get_secret_value()
    assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=CALL_S).status_code == 200


async def test_weaviate_store_without_the_key_is_refused(settings: Settings) -> None:
    assert settings.weaviate_http and settings.weaviate_grpc
    with pytest.raises(Exception, match=r"(?i)401|anonymous|unauthori|authenticat"):
        await WeaviateVectorStore.open(
            settings.weaviate_http, settings.weaviate_grpc, DIM, prefix=PREFIX, attempts=1, outage_s=5
        )


# -- memstream's own clients on the secured stack -----------------------------------------------------------------


async def test_remote_store_and_gateway_style_producer_end_to_end(settings: Settings) -> None:
    """What the gateway and a worker do, configured only by settings: wait for Kafka, create the topics, produce
    as the gateway does (acks=all, idempotent), read the topic with a tail consumer; write a change set and its
    vectors into Dgraph and Weaviate through RemoteMemoryStore, and read them back."""
    assert settings.broker
    await wait_for_kafka(settings.broker, timeout_s=60, settings=settings)
    created = await ensure_topics(settings, settings.broker)
    topics = TopicNames.from_settings(settings)
    assert topics.chat in created
    producer = await start_producer(
        settings.broker, acks="all", enable_idempotence=True, linger_ms=5, **kafka_client_options(settings)
    )
    try:
        await producer.send_and_wait(topics.chat, b'{"probe": 1}', key=b"user-1")
    finally:
        await producer.stop()
    consumer = tail_consumer(settings.broker, topics.chat, client_id="secure-test", settings=settings)
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), 60)
        assert record.value == b'{"probe": 1}'
    finally:
        await consumer.stop()

    user = f"sec-{uuid.uuid4().hex[:10]}"
    store = await RemoteMemoryStore.from_settings(settings, dim=DIM)
    try:
        vertex = Vertex(
            id=ids.object_id(user, "Lisbon"),
            user_id=user,
            kind=VertexKind.OBJECT,
            name="Lisbon",
            t_created=datetime(2024, 5, 1, tzinfo=UTC),
        )
        events = [f"{user}-e1"]
        change_set = ChangeSet(id=ids.change_set_id(user, events), user_id=user, event_ids=events, vertices=[vertex])
        vector = VectorItem(id=vertex.id, kind=VertexKind.OBJECT.value, text="Lisbon", vector=[0.1] * DIM)
        await store.apply(change_set, [vector])
        assert (await store.get_vertices(user, [vertex.id])).keys() == {vertex.id}
        assert (await store.stats(user)).events == 1
        hits = await store.search(user, [VertexKind.OBJECT.value], [0.1] * DIM, k=3)
        assert [hit.id for hit in hits] == [vertex.id]
        await store.delete_user(user)
    finally:
        await store.close()


def test_the_gateway_publishes_and_reads_back_on_the_secured_broker(settings: Settings) -> None:
    """The gateway itself, configured only by settings: its producer and its topic feeds authenticate, so a
    message is accepted (202: the broker acknowledged it) and an answer record put on the topic is served."""
    from fastapi.testclient import TestClient

    from schemas.events import Answer, AnswerStatus
    from streams.codec import encode
    from streams.gateway.app import create_app
    from streams.gateway.client import bearer
    from tests.conftest import api_key

    assert settings.broker
    topics = TopicNames.from_settings(settings)
    key = api_key(settings)
    answer = Answer(
        event_id="ans_q1",
        user_id="sec-gateway",
        event_time=datetime(2024, 5, 1, tzinfo=UTC),
        query_id="q1",
        trace_id="tr_q1",
        question="?",
        answer="yes",
        status=AnswerStatus.ANSWERED,
    )

    async def put_answer() -> None:
        producer = await start_producer(settings.broker or "", **kafka_client_options(settings))
        try:
            await producer.send_and_wait(topics.answers, encode(answer), key=b"sec-gateway")
        finally:
            await producer.stop()

    with TestClient(create_app(settings), headers=bearer(key)) as client:
        message = {"user_id": "sec-gateway", "speaker": "Ana", "text": "I moved to Porto.", "event_id": "m1"}
        accepted = client.post("/v1/messages", json=[message])
        assert accepted.status_code == 202, accepted.text
        asyncio.run(put_answer())
        served = client.get("/v1/answers/q1", params={"wait": 30})
        assert served.status_code == 200 and served.json()["answer"] == "yes"
