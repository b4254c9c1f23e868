"""Topic names and creation. Every topic is keyed by ``user_id`` so each user's events keep their order."""

from __future__ import annotations

from dataclasses import astuple, dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from services.logging import get_logger
from services.settings import Settings
from streams.kafka_security import kafka_client_options

log = get_logger(__name__)

_TOPIC_ALREADY_EXISTS = TopicAlreadyExistsError.errno


@dataclass(frozen=True)
class TopicNames:
    chat: str
    documents: str
    memory_updates: str
    queries: str
    stages: str
    answers: str
    dead_letters: str
    #: the answer's text while it is written (``AnswerText``): a preview for streaming readers
    answer_text: str = ""
    #: cancellations of queries being answered (``QueryCancel``), read by every worker
    query_control: str = ""

    @classmethod
    def from_settings(cls, settings: Settings) -> TopicNames:
        return cls(
            chat=settings.topic("chat"),
            documents=settings.topic("documents"),
            memory_updates=settings.topic("memory-updates"),
            queries=settings.topic("queries"),
            stages=settings.topic("stages"),
            answers=settings.topic("answers"),
            dead_letters=settings.topic("dead-letters"),
            answer_text=settings.topic("answer-text"),
            query_control=settings.topic("query-control"),
        )

    def all(self) -> list[str]:
        return [name for name in astuple(self) if name]


async def ensure_topics(settings: Settings, bootstrap: str) -> list[str]:
    """Create the missing topics with ``settings.partitions``; existing topics are left as they are.

    Returns the names created. Explicit creation rather than auto-create: partitions are the unit of ordering and
    parallelism, so their number is configuration, not a broker default.
    """
    names = TopicNames.from_settings(settings).all()
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id="memstream-admin", **kafka_client_options(settings)
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in names if n not in existing]
        if not missing:
            return []
        response = await admin.create_topics(
            [NewTopic(n, settings.partitions, settings.replication_factor) for n in missing]
        )
        created = []
        for topic_error in response.topic_errors:
            name, code = topic_error[0], topic_error[1]
            if code == 0:
                created.append(name)
            elif code != _TOPIC_ALREADY_EXISTS:  # a concurrent creator won the race: fine
                raise RuntimeError(f"could not create topic {name}: error {code} {topic_error[-1]}")
        log.info("topics_created", topics=created, partitions=settings.partitions)
        return created
    finally:
        await admin.close()
