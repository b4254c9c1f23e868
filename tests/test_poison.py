"""Poison never spreads, on the worker's side: every record is decoded and validated on its own (limits in
``schemas.validation``), a bad one becomes exactly one dead letter with its reason and its (cut) bytes, and every
good neighbour reaches the memorizer. Property-based (hypothesis) over raw records and every event contract."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from schemas.events import (
    CONTRACTS,
    ChatMessage,
    DeadLetter,
    Document,
    Forget,
    ForgetScope,
    MemoryForgotten,
    MemoryUpdate,
    Query,
)
from schemas.validation import MAX_JSON_DEPTH, MAX_RECORD_BYTES, MalformedJSON, parse_json
from streams.codec import KEY_MISMATCH, PAYLOAD_LIMIT, InvalidEvent, decode, encode, payload_text
from streams.handlers import MemorizeHandler, Record
from streams.topics import TopicNames

T0 = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)
TOPICS = TopicNames(*(f"t.{n}" for n in ("chat", "docs", "updates", "queries", "stages", "answers", "dead")))
FUZZ = settings(
    max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def chat_dict(n: int, user: str = "alice", **fields: Any) -> dict[str, Any]:
    return {
        "event_id": f"m{n}",
        "user_id": user,
        "event_time": T0.isoformat(),
        "speaker": "Anna",
        "text": f"message {n}",
        **fields,
    }


def raw(item: dict[str, Any]) -> bytes:
    return json.dumps(item).encode()  # ensure_ascii: a lone surrogate travels as a \\ud800 escape


# -- the limits -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (deep(100_000), "more than 32 levels deep"),
        (deep(MAX_JSON_DEPTH + 1), "more than 32 levels deep"),
        (b'{"a": "\\ud800"}', "lone UTF-16 surrogate escape (not a character) at a"),
        (b'["ok", {"\\udfff": 1}]', "surrogate escape (not a character) at [1].<key>"),
        ('"\ud800"'.encode("utf-8", "surrogatepass"), "not UTF-8"),  # the surrogate encoded, not escaped
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"n": NaN}', "NaN is not a JSON number"),
        (b"[" + b"9" * 5000 + b"]", "not valid JSON"),  # more digits than Python parses
        (b"", "not valid JSON"),
    ],
)
def test_malformed_json_is_rejected_with_the_reason(body: bytes, says: str) -> None:
    with pytest.raises(MalformedJSON) as caught:
        parse_json(body, MAX_RECORD_BYTES)
    assert says in str(caught.value)


def test_limits_let_the_largest_valid_input_through() -> None:
    brackets = "[" * 100 + "]{"
    assert parse_json(json.dumps({"a": brackets}).encode(), 1000) == {"a": brackets}  # in a string: not nesting
    assert parse_json(deep(MAX_JSON_DEPTH), 1000) is not None
    document = Document(event_id="d1", user_id="u", event_time=T0, document_id="d1", text="😀" * 200_000)
    assert decode(encode(document), Document) == document  # 800 kB of 4-byte characters fit a record
    with pytest.raises(MalformedJSON, match="more than the limit") as caught:
        parse_json(b" " * 1001, 1000)
    assert caught.value.status == 413


FAR_FUTURE = "9999-12-31T23:59:59-14:00"  # valid ISO, but its UTC value is past year 9999


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"event_time": FAR_FUTURE}, "event_time"),
        ({"event_time": "1899-12-31T23:59:59Z"}, "event_time: Value error, must be between 1900-01-01"),
        ({"event_time": (datetime.now(UTC) + timedelta(days=4000)).isoformat()}, "event_time"),
        ({"event_time": "2024-03-02T10:00:00"}, "event_time: Input should have timezone info"),
        ({"ingest_time": FAR_FUTURE}, "ingest_time"),
        ({"speaker": "Anna\n"}, "speaker: Value error, contains a control character"),
        ({"speaker": "An\x1bna"}, "speaker: Value error, contains a control character"),
        ({"text": "nul \x00 byte"}, "text: Value error, contains a NUL character"),
        ({"text": "\ud800"}, "lone UTF-16 surrogate"),
        ({"speaker": "\udc00"}, "lone UTF-16 surrogate"),
        ({"user_id": "alice\n"}, "user_id: String should match pattern"),
        ({"user_id": "\ud800"}, "lone UTF-16 surrogate"),
        ({"platform": "tele\tgram"}, "platform: Value error, contains a control character"),
    ],
)
def test_one_bad_field_rejects_the_record_with_its_name(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidEvent) as caught:
        decode(raw(chat_dict(1, **fields)), ChatMessage)
    assert says in str(caught.value)


def test_text_keeps_its_line_breaks_and_tabs_and_a_query_its_window() -> None:
    ok = decode(raw(chat_dict(1, text="line one\n\tline two\r\n\x0cpage")), ChatMessage)
    assert ok.text.startswith("line one")
    question = {"event_id": "q1", "user_id": "alice", "event_time": T0.isoformat(), "question": "?"}
    assert decode(raw(question), Query).question == "?"
    with pytest.raises(InvalidEvent, match="as_of"):
        decode(raw(question | {"as_of": FAR_FUTURE}), Query)


# -- the handler: bad records alone in the dead letters, good ones memorized --------------------------------------


@dataclass
class Published:
    sent: list[tuple[str, bytes | None, bytes]] = field(default_factory=list)

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        self.sent.append((topic, key, value))

    def dead_letters(self) -> list[DeadLetter]:
        return [DeadLetter.model_validate_json(v) for t, _, v in self.sent if t == TOPICS.dead_letters]


@dataclass
class Outcome:
    updates: list[MemoryUpdate] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)


@dataclass
class Memorizer:
    """Keeps what it was given; ``breaks_on``: an event id whose presence makes the whole call raise."""

    breaks_on: str | None = None
    calls: list[list[str]] = field(default_factory=list)
    memorized: list[str] = field(default_factory=list)

    async def memorize(self, events: Sequence[ChatMessage | Document], source_topic: str = "") -> Outcome:
        ids = [e.event_id for e in events]
        self.calls.append(ids)
        if self.breaks_on in ids:
            raise OverflowError("date value out of range")  # a bug the data triggered, deep in the service
        self.memorized.extend(ids)
        return Outcome()


async def handle(records: list[Record], memorizer: Memorizer | None = None) -> tuple[Memorizer, Published]:
    memorizer = memorizer or Memorizer()
    published = Published()
    await MemorizeHandler(memorizer, published, TOPICS).handle(records)
    return memorizer, published


def chat_record(item: dict[str, Any], key: bytes | None = b"alice") -> Record:
    return Record(TOPICS.chat, key, raw(item))


async def test_the_measured_poison_is_dead_lettered_alone_and_its_neighbours_memorized() -> None:
    deep_record = Record(TOPICS.chat, b"alice", deep(100_000))
    records = [
        chat_record(chat_dict(1)),
        deep_record,
        chat_record(chat_dict(2)),
        chat_record(chat_dict(3, event_time=FAR_FUTURE)),
        chat_record(chat_dict(4, user="bob"), key=b"alice"),  # bob's event under alice's key
        chat_record(chat_dict(5, text="lone \ud800 surrogate")),
        chat_record(chat_dict(6)),
    ]
    memorizer, published = await handle(records)
    assert sorted(memorizer.memorized) == ["m1", "m2", "m6"]
    letters = published.dead_letters()
    assert [(d.reason, d.failed_event_ids, d.user_id) for d in letters] == [
        ("invalid_event", [], None),
        ("invalid_event", ["m3"], "alice"),
        (KEY_MISMATCH, ["m4"], "bob"),
        ("invalid_event", ["m5"], "alice"),
    ]
    huge = letters[0]
    assert "levels deep" in huge.error and huge.payload_bytes == 200_000
    assert huge.payload == "[" * PAYLOAD_LIMIT  # cut to the limit, and says how big it was
    assert (
        "event_time" in letters[1].error and "record key 'alice' is not the event's user_id 'bob'" in letters[2].error
    )
    assert ChatMessage.model_validate_json(letters[2].payload).event_id == "m4"  # replayable under the right key
    # dead letters are keyed by the user they name, so an operator finds them per user
    assert [k for t, k, _ in published.sent if t == TOPICS.dead_letters] == [None, b"alice", b"bob", b"alice"]


async def test_an_event_that_breaks_memorize_is_isolated_from_its_neighbours() -> None:
    records = [chat_record(chat_dict(n)) for n in range(1, 8)]
    memorizer, published = await handle(records, Memorizer(breaks_on="m5"))
    assert sorted(memorizer.memorized) == ["m1", "m2", "m3", "m4", "m6", "m7"]
    (letter,) = published.dead_letters()
    assert letter.reason == "processing_failed" and letter.failed_event_ids == ["m5"]
    assert "date value out of range" in letter.error
    assert len(memorizer.calls) <= 1 + 2 * 3  # halving: one call per level and side, not one per event


# -- property: whatever arrives, one outcome per record -----------------------------------------------------------

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["\ud800", "a\udfffb", "\x00", "\n", FAR_FUTURE, "1899-01-01T00:00:00Z", ""])
)
JSON_VALUES = st.recursive(
    JSON_LEAVES, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c), max_leaves=20
)
FIELDS = [*sorted(ChatMessage.model_fields), "colour"]


@st.composite
def raw_records(draw: st.DrawFn, n: int) -> tuple[Record, bool | None]:
    """A record and whether it is good (True), bad (False), or either (None: a random mutation)."""
    kind = draw(st.sampled_from(["bytes", "json", "deep", "valid", "mutated", "wrong_key"]))
    if kind == "bytes":
        return Record(TOPICS.chat, b"alice", draw(st.binary(max_size=200))), False
    if kind == "json":
        return Record(TOPICS.chat, b"alice", json.dumps(draw(JSON_VALUES)).encode()), False
    if kind == "deep":
        return Record(TOPICS.chat, b"alice", deep(draw(st.integers(MAX_JSON_DEPTH + 1, 100_000)))), False
    user = draw(st.sampled_from(["alice", "bob"]))
    item = chat_dict(n, user=user)
    if kind == "wrong_key":
        return chat_record(item, key=draw(st.sampled_from([None, b"", b"mallory", user.encode() + b" "]))), False
    if kind == "mutated":
        name = draw(st.sampled_from(FIELDS))
        item[name] = draw(JSON_VALUES)
        return chat_record(item, key=user.encode()), None
    return chat_record(item, key=user.encode()), True


@FUZZ
@given(st.lists(st.integers(0, 10**6).flatmap(raw_records), min_size=1, max_size=12))
async def test_any_records_each_become_one_dead_letter_or_reach_the_memorizer(
    drawn: list[tuple[Record, bool | None]],
) -> None:
    records = [record for record, _ in drawn]
    memorizer, published = await handle(records)  # never raises
    letters = published.dead_letters()
    assert len(letters) + len(memorizer.memorized) == len(records)  # one outcome per record, none lost
    dead_payloads = Counter(d.payload for d in letters)
    for record, good in drawn:
        if good is False:
            assert dead_payloads[payload_text(record.value)] >= 1, record
    assert Counter(memorizer.memorized) >= Counter(
        json.loads(record.value or b"")["event_id"] for record, good in drawn if good
    )
    for letter in letters:
        assert letter.reason in ("invalid_event", KEY_MISMATCH) and letter.error
        assert letter.payload_bytes is not None and len(letter.payload) <= PAYLOAD_LIMIT
        encode(letter)  # and it can be published


# -- property: every contract validates or rejects, never crashes, and what it accepts can travel ------------------


def samples() -> dict[str, BaseModel]:
    base = {"event_id": "e1", "user_id": "alice", "event_time": T0}
    query = Query(**base, question="Where does Anna work?")
    return {
        "chat_message": ChatMessage(**base, speaker="Anna", text="hi"),
        "document": Document(**base, document_id="d1", text="CV", title="CV"),
        "memory_update": MemoryUpdate(**base, change_set_id="c1", source_event_ids=["e0"]),
        "forget": Forget(**base, scope=ForgetScope.CONVERSATION, target="c1"),
        "memory_forgotten": MemoryForgotten(
            **base, forget_id="e1", source_topic="chat", scope=ForgetScope.MESSAGE, target="m1", removed_ids=["t_1"]
        ),
        "query": query,
        "stage_event": CONTRACTS["stage_event"].model_validate(
            {
                **base,
                "query_id": "q",
                "trace_id": "t",
                "stage": 1,
                "stage_name": "s",
                "started_at": T0,
                "duration_ms": 1.0,
                "detail": {"k": [1, {"x": "y"}]},
            }
        ),
        "answer": CONTRACTS["answer"].model_validate(
            {**base, "query_id": "q", "trace_id": "t", "question": "?", "answer": "!", "status": "answered"}
        ),
        "answer_text": CONTRACTS["answer_text"].model_validate({**base, "query_id": "q", "seq": 1, "text": "An"}),
        "query_cancel": CONTRACTS["query_cancel"].model_validate({**base, "query_id": "q", "reason": "deleted"}),
        "dead_letter": DeadLetter(event_id="dl", source_topic="t", reason="r", error="e", payload="p"),
    }


def test_every_contract_has_a_sample() -> None:
    assert set(samples()) == set(CONTRACTS)


@FUZZ
@given(st.sampled_from(sorted(CONTRACTS)), st.data())
def test_every_contract_rejects_or_accepts_a_mutated_field_and_what_it_accepts_encodes(
    name: str, data: st.DataObject
) -> None:
    model = CONTRACTS[name]
    item = json.loads(samples()[name].model_dump_json())
    field_name = data.draw(st.sampled_from([*sorted(model.model_fields), "unknown"]))
    item[field_name] = data.draw(JSON_VALUES)
    body = json.dumps(item).encode()
    try:
        event = decode(body, model)
    except InvalidEvent as exc:
        assert str(exc)
        if isinstance(exc.__cause__, ValidationError):  # the model's own verdict on the same item
            with pytest.raises(ValidationError):
                model.model_validate(item)
        else:
            assert isinstance(exc.__cause__, MalformedJSON)
        return
    assert decode(encode(event), model) == event  # what was accepted can be published and read back
