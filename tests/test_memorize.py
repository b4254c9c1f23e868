"""Memorize over the real embedded store and embedder, with a scripted extractor (the LLM is the only double)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from schemas.events import ChatMessage, Document
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, EdgeKind, Vertex, VertexKind
from services.llm.layers import RetryingLLM
from services.llm.scope import is_ahead
from services.llm.scripted import MEMORIZE_RULES, ScriptedLLM, rule_extract, rule_resolve_check
from services.memorize.service import TAKE_BATCHES, MemorizeService
from services.settings import Settings

T0 = datetime(2023, 5, 1, 9, 0, tzinfo=UTC)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


INGEST = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteMemoryStore]:
    s = SqliteMemoryStore(tmp_path / "m.sqlite3", dim=384)
    yield s
    await s.close()


def msg(n: int, text: str, user: str = "u1", speaker: str = "Anna", at: datetime | None = None) -> ChatMessage:
    return ChatMessage(
        event_id=f"m{n}",
        user_id=user,
        speaker=speaker,
        text=text,
        event_time=at or T0 + timedelta(minutes=n),
        ingest_time=INGEST + timedelta(seconds=n),
    )


def reply(*facts: dict, count: int = 1) -> dict:
    """The extraction reply for ``count`` messages, all ``facts`` under the first."""
    return {"messages": [{"m": n, "facts": list(facts) if n == 1 else []} for n in range(1, count + 1)]}


def fact(text: str, subject: str = "Anna", relation: str = "", obj: str = "", when: str = "", **labels: str) -> dict:
    return {
        "subject": subject,
        "fact": text,
        "relation": relation,
        "object": obj,
        "when": when,
        "kind": labels.get("kind", "FACT"),
        "temporal": labels.get("temporal", "DYNAMIC"),
    }


def verdicts(*words: str) -> dict:
    return {"pairs": [{"p": n, "verdict": w} for n, w in enumerate(words, start=1)]}


def service(
    store: SqliteMemoryStore, llm: ScriptedLLM, embedder: MiniLMEmbedder, **overrides: object
) -> MemorizeService:
    settings = Settings(data_dir=Path("unused"), **overrides)  # type: ignore[arg-type]
    return MemorizeService(store.stores(), llm, embedder, settings)


async def test_builds_all_vertex_and_edge_kinds_with_timestamps(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Paris.", "Anna", "Lives In", "Paris")))
    outcome = await service(store, llm, embedder).memorize([msg(1, "I live in Paris.")])
    assert not outcome.dead_letters and len(outcome.updates) == 1
    stats = await store.stats("u1")
    assert stats.vertices == {"episodic": 1, "thesis": 1, "object": 2}
    assert stats.edges == {"relation": 1, "thesis": 2, "episodic": 3}
    t = (await store.get_vertices("u1", [ids.thesis_id("u1", "Anna lives in Paris.")]))[
        ids.thesis_id("u1", "Anna lives in Paris.")
    ]
    assert t.t_valid == T0 + timedelta(minutes=1) and t.t_created == INGEST + timedelta(seconds=1)
    assert t.t_invalid is None and t.episode_label == "FACT" and t.temporal_label == "DYNAMIC"
    update = outcome.updates[0]
    assert update.source_event_ids == ["m1"] and update.theses_added == 1 and update.llm_calls == 1


async def test_replay_changes_nothing_and_costs_no_llm_call(store, embedder) -> None:
    llm = ScriptedLLM(dict(MEMORIZE_RULES))
    events = [msg(i, f"I met Bob at the Louvre on day {i}.") for i in range(1, 6)]
    svc = service(store, llm, embedder)
    first = await svc.memorize(events)
    before = await store.dump()
    calls = len(llm.calls)
    # redelivered before its memory update was announced (a crash in between): the same update, announced again
    again = await svc.memorize(events)
    assert again.skipped == sorted(e.event_id for e in events)
    assert [u.model_dump() for u in again.updates] == [u.model_dump() for u in first.updates]
    await svc.announced(again.updates)
    # redelivered after the announcement: nothing at all
    third = await svc.memorize(events)
    assert third.skipped == again.skipped and not third.updates
    assert len(llm.calls) == calls
    assert await store.dump() == before


async def test_replay_of_a_change_set_after_crash_is_byte_identical(store, embedder) -> None:
    """Same events re-extracted from scratch (e.g. the write was lost) produce the same rows."""
    llm = ScriptedLLM(dict(MEMORIZE_RULES))
    events = [msg(i, f"Carl joined Greenpeace in Oslo, note {i}.") for i in range(1, 4)]
    await service(store, llm, embedder).memorize(events)
    first = await store.dump()
    other = SqliteMemoryStore(store.path.parent / "other.sqlite3", dim=384)  # type: ignore[attr-defined]
    try:
        await service(other, ScriptedLLM(dict(MEMORIZE_RULES)), embedder).memorize(events)
        await service(other, ScriptedLLM(dict(MEMORIZE_RULES)), embedder).memorize(events)
        assert await other.dump() == first
    finally:
        await other.close()


async def test_contradiction_invalidates_without_deleting(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I live in Paris.")])
    llm.queue("extract", reply(fact("Anna lives in Berlin.", relation="lives in", obj="Berlin")))

    def judge(request):  # the known thesis is found for the new fact and judged with it, after extraction
        assert "NEW (2023-05-31): Anna lives in Berlin." in request.messages[-1].content
        assert "KNOWN (2023-05-01): Anna lives in Paris." in request.messages[-1].content
        return verdicts("updates")

    llm.responders["resolve"] = judge
    llm.responders["resolve_check"] = rule_resolve_check
    later = msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))
    outcome = await svc.memorize([later])
    assert all("Paris" not in m.content for r in llm.calls_for("extract")[1:] for m in r.messages[-1:])
    # extraction, resolve, and the check that confirmed the update
    assert outcome.updates[0].theses_invalidated == 1 and outcome.updates[0].llm_calls == 3
    old_id, new_id = ids.thesis_id("u1", "Anna lives in Paris."), ids.thesis_id("u1", "Anna lives in Berlin.")
    found = await store.get_vertices("u1", [old_id, new_id])
    old = found[old_id]
    assert old.t_invalid == later.event_time and old.invalidated_by == new_id
    assert old.t_expired == later.ingest_time
    assert found[new_id].t_invalid is None
    assert old.valid_at(T0 + timedelta(days=1)) and not old.valid_at(None)
    stats = await store.stats("u1")
    assert (stats.theses_valid, stats.theses_invalidated) == (1, 1)
    assert [v.id for v in await store.valid_theses("u1")] == [new_id]


async def paris_then_berlin(store: SqliteMemoryStore, embedder: MiniLMEmbedder, one_batch: bool) -> ScriptedLLM:
    """Anna lives in Paris (1 May), then moved to Berlin (31 May): in one memorize batch or in two."""
    paris = fact("Anna lives in Paris.", relation="lives in", obj="Paris")
    berlin = fact("Anna lives in Berlin.", relation="lives in", obj="Berlin")
    messages = [msg(1, "I live in Paris."), msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))]
    llm = ScriptedLLM()

    def judge(request: Any) -> dict:
        # the earlier fact is shown as known, with its own date, whether it came in this batch or before
        assert "NEW (2023-05-31): Anna lives in Berlin.\n    KNOWN (2023-05-01): Anna lives in Paris." in (
            request.messages[-1].content
        )
        return verdicts("updates")

    llm.responders["resolve"] = judge
    llm.responders["resolve_check"] = rule_resolve_check
    svc = service(store, llm, embedder)
    if one_batch:
        llm.queue("extract", {"messages": [{"m": 1, "facts": [paris]}, {"m": 2, "facts": [berlin]}]})
        await svc.memorize(messages)
    else:
        llm.queue("extract", reply(paris), reply(berlin))
        await svc.memorize(messages[:1])
        await svc.memorize(messages[1:])
    return llm


async def test_a_batch_that_holds_the_old_state_and_the_new_ends_the_old(store, embedder, tmp_path) -> None:
    """A batch may span months of a chat history: its earlier facts are judged with its later ones, and memory ends
    as it would have, had the two messages come in batches of their own (a new-user trial sent April's "I'm a
    chemistry teacher" and September's "I now work at Novagen" in one batch, and nothing was judged)."""
    llm = await paris_then_berlin(store, embedder, one_batch=True)
    assert len(llm.calls_for("extract")) == 1 and len(llm.calls_for("resolve")) == 1
    paris, berlin = ids.thesis_id("u1", "Anna lives in Paris."), ids.thesis_id("u1", "Anna lives in Berlin.")
    found = await store.get_vertices("u1", [paris, berlin])
    assert found[paris].invalidated_by == berlin and found[paris].t_invalid == T0 + timedelta(days=30)
    assert found[berlin].t_invalid is None
    lives_in_paris = ids.stated_relation("u1", found[paris].props)
    edges = await store.neighbors("u1", [ids.object_id("u1", "Paris")], [EdgeKind.RELATION])
    assert [(t.edge.id, t.edge.t_invalid) for t in edges] == [(lives_in_paris, T0 + timedelta(days=30))]

    apart = SqliteMemoryStore(tmp_path / "apart.sqlite3", dim=384)
    try:
        await paris_then_berlin(apart, embedder, one_batch=False)
        alone = await apart.get_vertices("u1", [paris, berlin])
        validity = ("t_valid", "t_invalid", "t_expired", "invalidated_by")
        assert [found[t].model_dump(include=set(validity)) for t in (paris, berlin)] == [
            alone[t].model_dump(include=set(validity)) for t in (paris, berlin)
        ]
        assert (await apart.stats("u1")).theses_valid == (await store.stats("u1")).theses_valid == 1
    finally:
        await apart.close()


def check_replies(*words: str) -> dict:
    return {"pairs": [{"p": n, "verdict": w} for n, w in enumerate(words, start=1)]}


async def two_states(store: SqliteMemoryStore, embedder: MiniLMEmbedder, **overrides: object) -> ScriptedLLM:
    """Anna lives in Paris, then in Berlin, with "updates" from resolve; the check is left to the caller."""
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    svc = service(store, llm, embedder, **overrides)
    await svc.memorize([msg(1, "I live in Paris.")])
    llm.queue("extract", reply(fact("Anna lives in Berlin.", relation="lives in", obj="Berlin")))
    llm.queue("resolve", verdicts("updates"))
    return llm


def resolve_check_count(verdict: str) -> float:
    return REGISTRY.get_sample_value("memstream_resolve_pairs_total", {"verdict": verdict}) or 0.0


async def test_an_update_the_check_does_not_confirm_keeps_both(store, embedder) -> None:
    llm = await two_states(store, embedder)
    # the controls (first: holds, last: ends) answered right: the check is trusted, and says both can hold
    llm.queue("resolve_check", check_replies("both_true", "both_true", "not_both"))
    before = resolve_check_count("updates_unconfirmed_kept")
    svc = service(store, llm, embedder)
    outcome = await svc.memorize([msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))])
    # the check is shown the pair resolve judged, the other way round
    (check,) = llm.calls_for("resolve_check")
    assert "NEW (2023-05-31): Anna lives in Berlin.\n    KNOWN (2023-05-01): Anna lives in Paris." in (
        check.messages[-1].content
    )
    assert outcome.updates[0].theses_invalidated == 0 and outcome.updates[0].llm_calls == 3
    assert (await store.stats("u1")).theses_valid == 2
    assert resolve_check_count("updates_unconfirmed_kept") == before + 1


async def test_a_check_that_fails_its_controls_is_not_trusted(store, embedder) -> None:
    llm = await two_states(store, embedder)
    # "not_both" to every pair, the control that holds together included: this call cannot tell the kinds apart
    llm.queue("resolve_check", check_replies("not_both", "not_both", "not_both"))
    before = resolve_check_count("check_controls_failed")
    outcome = await service(store, llm, embedder).memorize([msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))])
    (check,) = llm.calls_for("resolve_check")
    lines = check.messages[-1].content.splitlines()
    assert "Robin is looking forward to the jazz festival." in lines[0] and "Robin moved to Leeds." in lines[-2]
    kept_before = resolve_check_count("updates_unconfirmed_kept")
    assert outcome.updates[0].theses_invalidated == 0
    assert (await store.stats("u1")).theses_valid == 2
    assert resolve_check_count("check_controls_failed") == before + 1
    assert resolve_check_count("updates_unconfirmed_kept") == kept_before  # one reason, counted once


async def test_a_trusted_check_that_agrees_lets_the_update_act(store, embedder) -> None:
    llm = await two_states(store, embedder)
    llm.queue("resolve_check", check_replies("both_true", "not_both", "not_both"))
    outcome = await service(store, llm, embedder).memorize([msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))])
    assert outcome.updates[0].theses_invalidated == 1


async def test_a_failed_check_keeps_both(store, embedder) -> None:
    llm = await two_states(store, embedder)
    llm.queue("resolve_check", "not json", "still not", "nor this")  # every attempt rejected
    before = REGISTRY.get_sample_value("memstream_extraction_failures_total", {"reason": "resolve_check_failed"}) or 0
    outcome = await service(store, llm, embedder).memorize([msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))])
    assert outcome.updates[0].theses_invalidated == 0 and not outcome.dead_letters
    assert REGISTRY.get_sample_value("memstream_extraction_failures_total", {"reason": "resolve_check_failed"}) == (
        before + 1
    )


async def test_no_check_is_asked_for_a_verdict_the_labels_keep_anyway(store, embedder) -> None:
    """An opinion never ends a fact (``labels.decide``): its "updates" is kept whatever a check would say."""
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I live in Paris.")])
    opinion = fact("Anna lives in Berlin.", relation="lives in", obj="Berlin", kind="OPINION")
    llm.queue("extract", reply(opinion))
    llm.queue("resolve", verdicts("updates"))
    outcome = await svc.memorize([msg(2, "I live in Berlin, I think.", at=T0 + timedelta(days=30))])
    assert llm.calls_for("resolve") and llm.calls_for("resolve_check") == []
    assert outcome.updates[0].theses_invalidated == 0 and outcome.updates[0].llm_calls == 2


async def test_the_check_can_be_turned_off(store, embedder) -> None:
    llm = await two_states(store, embedder)
    outcome = await service(store, llm, embedder, resolve_check=False).memorize(
        [msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))]
    )
    assert llm.calls_for("resolve_check") == [] and outcome.updates[0].theses_invalidated == 1


async def test_a_model_that_keeps_failing_the_controls_is_asked_again_only_later(store, embedder) -> None:
    """After ``resolve_untrusted_after`` checks in a row whose controls came back wrong, the next
    ``resolve_untrusted_skip`` batches with pairs keep both statements without a call (counted); then the model is
    asked again, and a check with its controls right lets its verdicts act again."""
    right = {"controls": False}

    def resolve(request: Any) -> dict:
        return verdicts(*["updates"] * request.messages[-1].content.count(" NEW ("))

    def check(request: Any) -> dict:
        if right["controls"]:
            return rule_resolve_check(request)
        return check_replies(*["not_both"] * request.messages[-1].content.count(" NEW ("))

    llm = ScriptedLLM({"resolve": resolve, "resolve_check": check})
    svc = service(store, llm, embedder, resolve_untrusted_after=2, resolve_untrusted_skip=2)

    async def moved(n: int) -> Any:
        city = ["Paris", "Berlin", "Rome", "Oslo", "Porto", "Vienna", "Prague"][n]
        llm.queue("extract", reply(fact(f"Anna lives in {city}.", relation="lives in", obj=city)))
        return await svc.memorize([msg(n, f"I live in {city} now.", at=T0 + timedelta(days=30 * n))])

    def asked() -> tuple[int, int]:
        return len(llm.calls_for("resolve")), len(llm.calls_for("resolve_check"))

    await moved(0)  # nothing known yet: no pair
    await moved(1)
    await moved(2)
    assert asked() == (2, 2)  # two checks whose controls failed: the verdicts acted on nothing
    skipped = resolve_check_count("skipped_untrusted")
    outcomes = [await moved(3), await moved(4)]
    assert asked() == (2, 2)  # not asked: both statements of every pair kept, as the failed controls did
    assert [o.updates[0].llm_calls for o in outcomes] == [1, 1]  # the extraction alone
    assert resolve_check_count("skipped_untrusted") > skipped
    assert (await store.stats("u1")).theses_valid == 5
    right["controls"] = True
    outcome = await moved(5)  # asked again; its controls right: the update acts
    assert asked() == (3, 3) and outcome.updates[0].theses_invalidated >= 1
    await moved(6)
    assert asked() == (4, 4)  # trusted again: asked as before


async def test_a_repeated_fact_adds_a_source_not_a_copy(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna enjoys hiking in the mountains.", obj="mountains")))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I enjoy hiking in the mountains.")])
    llm.queue("extract", reply(fact("Anna likes hiking in mountains.", obj="mountains")))
    llm.queue("resolve", verdicts("same"))
    await svc.memorize([msg(2, "I like hiking in mountains a lot.")])
    assert llm.calls_for("resolve_check") == []  # nothing would end: nothing to check
    assert (await store.stats("u1")).vertices["thesis"] == 1
    known = ids.thesis_id("u1", "Anna enjoys hiking in the mountains.")
    episodes = {t.end.id for t in await store.neighbors("u1", [known]) if t.end.kind is VertexKind.EPISODIC}
    assert episodes == {ids.episode_id("u1", "m1"), ids.episode_id("u1", "m2")}


async def test_unrelated_facts_are_not_judged(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I live in Paris.")])
    llm.queue("extract", reply(fact("Anna bought a red bicycle.", obj="bicycle")))
    await svc.memorize([msg(2, "I bought a red bicycle.")])
    assert llm.calls_for("resolve") == []  # no candidate near enough: no call


async def test_late_event_about_the_past_is_the_one_invalidated(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Berlin.", relation="lives in", obj="Berlin")))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I live in Berlin.", at=T0 + timedelta(days=30))])
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    llm.queue("resolve", verdicts("updates"))
    llm.responders["resolve_check"] = rule_resolve_check
    await svc.memorize([msg(2, "I live in Paris.", at=T0)])  # said earlier, arrived later
    berlin, paris = ids.thesis_id("u1", "Anna lives in Berlin."), ids.thesis_id("u1", "Anna lives in Paris.")
    found = await store.get_vertices("u1", [berlin, paris])
    assert found[berlin].t_invalid is None
    assert found[paris].t_invalid == T0 + timedelta(days=30) and found[paris].invalidated_by == berlin


async def test_a_message_with_no_facts_says_why(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna adopted a parrot.", obj="parrot"), count=2))
    before = sample("memstream_memorize_no_facts_total", reason="all_dropped")
    await service(store, llm, embedder).memorize([msg(1, "Hi Ben, how are you?"), msg(2, "Good, you?", speaker="Ben")])
    episodes = await store.get_vertices("u1", [ids.episode_id("u1", "m1"), ids.episode_id("u1", "m2")])
    assert episodes[ids.episode_id("u1", "m1")].props["no_facts"] == "all_dropped"  # the parrot is not in it
    assert episodes[ids.episode_id("u1", "m2")].props["no_facts"] == "none_listed"
    assert sample("memstream_memorize_no_facts_total", reason="all_dropped") == before + 1
    # each message still hangs from the one who said it: retrievers reach and show it by its words
    linked = await store.neighbors("u1", [ids.object_id("u1", "Ben")], [EdgeKind.EPISODIC])
    assert [t.end.id for t in linked] == [ids.episode_id("u1", "m2")]


async def test_a_message_the_model_skipped_is_asked_again(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", {"messages": [{"m": 1, "facts": []}]})  # no entry for message 2
    llm.queue("extract", reply(fact("Ben plays the cello.", subject="Ben", obj="cello")))
    outcome = await service(store, llm, embedder).memorize(
        [msg(1, "Hello!"), msg(2, "I play the cello.", speaker="Ben")]
    )
    assert len(llm.calls_for("extract")) == 2 and "[1] Ben" in llm.calls_for("extract")[1].messages[-1].content
    assert outcome.updates[0].theses_added == 1


async def test_an_unreachable_model_dead_letters_with_the_attempts_made(store, embedder) -> None:
    class Down(ScriptedLLM):
        async def complete(self, request):
            self.calls.append(request)
            raise TimeoutError("no progress")

    down = Down()
    llm = RetryingLLM(down, attempts=3, backoff_s=0.001)
    outcome = await service(store, llm, embedder).memorize([msg(1, "I live in Paris.")], source_topic="chat")
    [dead] = outcome.dead_letters
    assert dead.reason == "llm_unavailable" and dead.attempts == 3 == len(down.calls)


async def test_micro_batching_cuts_llm_calls_per_message(store, embedder) -> None:
    events = [msg(i, f"Message number {i} about Rome.") for i in range(1, 17)]
    batched = ScriptedLLM(dict(MEMORIZE_RULES))
    await service(store, batched, embedder, batch_max_messages=8).memorize(events)
    assert len(batched.calls_for("extract")) == 2
    single = ScriptedLLM(dict(MEMORIZE_RULES))
    events2 = [msg(100 + i, f"Message number {i} about Rome.", user="u2") for i in range(1, 17)]
    await service(store, single, embedder, batch_max_messages=1).memorize(events2)
    assert len(single.calls_for("extract")) == 16


async def test_a_users_groups_are_extracted_together_and_written_in_order(store, embedder) -> None:
    class AllAtOnce(ScriptedLLM):
        """Holds each extraction call until three are in flight: one call at a time times out instead."""

        def __init__(self) -> None:
            super().__init__(dict(MEMORIZE_RULES))
            self.arrived = 0
            self.all_in = asyncio.Event()

        async def complete(self, request):
            if request.task == "extract":
                self.arrived += 1
                if self.arrived == 3:
                    self.all_in.set()
                await asyncio.wait_for(self.all_in.wait(), timeout=10)
            return await super().complete(request)

    llm = AllAtOnce()
    events = [msg(i, f"Message number {i} about Rome.") for i in range(1, 25)]
    outcome = await service(store, llm, embedder, batch_max_messages=8, llm_retries=0).memorize(events)
    assert outcome.dead_letters == []
    assert [u.source_event_ids for u in outcome.updates] == [[f"m{i}" for i in range(s, s + 8)] for s in (1, 9, 17)]
    assert await store.seen_events("u1", [e.event_id for e in events]) == {e.event_id for e in events}


async def test_extraction_is_sent_ahead_and_the_checks_a_write_waits_on_are_not(store, embedder) -> None:
    """The engine's background slots go to a group's checks before the later groups' extraction (``LimitedLLM``)."""

    class Marked(ScriptedLLM):
        def __init__(self) -> None:
            super().__init__()
            self.ahead: dict[str, set[bool]] = {}

        async def complete(self, request):
            self.ahead.setdefault(request.task, set()).add(is_ahead())
            return await super().complete(request)

    llm = Marked()
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    llm.queue("extract", reply(fact("Anna lives in Berlin.", relation="lives in", obj="Berlin")))
    llm.responders["resolve"] = lambda _request: verdicts("updates")
    llm.responders["resolve_check"] = rule_resolve_check
    svc = service(store, llm, embedder, batch_max_messages=1)
    outcome = await svc.memorize([msg(1, "I live in Paris."), msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))])
    assert outcome.updates[1].theses_invalidated == 1
    assert llm.ahead == {"extract": {True}, "resolve": {False}, "resolve_check": {False}}


async def test_a_backlog_is_memorized_in_worker_steps_each_user_in_order(store, embedder) -> None:
    llm = ScriptedLLM(dict(MEMORIZE_RULES))
    memorize = service(store, llm, embedder, batch_max_messages=2)
    step = 2 * TAKE_BATCHES
    u1 = [msg(i, f"Message number {i} about Rome.") for i in range(1, step + 4)]
    u2 = [msg(100 + i, f"Message number {i} about Oslo.", user="u2") for i in range(1, 4)]
    backlog = [e for pair in zip(u1, u2 + [None] * len(u1), strict=False) for e in pair if e is not None]
    steps: list[tuple[str, list[str], list[str]]] = []
    await memorize.memorize_backlog(
        backlog,
        lambda chunk, outcome: steps.append(
            (chunk[0].user_id, [e.event_id for e in chunk], [i for u in outcome.updates for i in u.source_event_ids])
        ),
    )
    assert [s for s in steps if s[0] == "u1"] == [
        ("u1", [e.event_id for e in u1[:step]], [e.event_id for e in u1[:step]]),
        ("u1", [e.event_id for e in u1[step:]], [e.event_id for e in u1[step:]]),
    ]
    assert [s for s in steps if s[0] == "u2"] == [("u2", [e.event_id for e in u2], [e.event_id for e in u2])]


async def test_token_budget_bounds_a_batch(store, embedder) -> None:
    llm = ScriptedLLM(dict(MEMORIZE_RULES))
    events = [msg(i, "Long story about Venice. " * 40) for i in range(1, 5)]  # ~250 tokens each
    await service(store, llm, embedder, batch_max_messages=8, batch_token_budget=600).memorize(events)
    assert len(llm.calls) == 2


async def test_poison_message_is_dead_lettered_and_neighbours_survive(store, embedder) -> None:
    def extract(request):
        if any("POISON" in m.content for m in request.messages):
            return "{broken"
        return rule_extract(request)

    llm = ScriptedLLM({**MEMORIZE_RULES, "extract": extract})
    events = [msg(1, "Hello from Madrid."), msg(2, "POISON pill"), msg(3, "Greetings from Lisbon.")]
    outcome = await service(store, llm, embedder, extraction_attempts=2).memorize(events, source_topic="chat")
    assert [d.failed_event_ids for d in outcome.dead_letters] == [["m2"]]
    dead = outcome.dead_letters[0]
    assert dead.reason == "extraction_failed" and "not valid JSON" in dead.error and dead.source_topic == "chat"
    assert ChatMessage.model_validate_json(dead.payload).text == "POISON pill"
    assert sorted(e for u in outcome.updates for e in u.source_event_ids) == ["m1", "m3"]
    assert await store.seen_events("u1", ["m1", "m2", "m3"]) == {"m1", "m3"}


async def test_documents_are_chunked_into_episodes(store, embedder) -> None:
    llm = ScriptedLLM(dict(MEMORIZE_RULES))
    doc = Document(
        event_id="d1",
        user_id="u1",
        document_id="guide",
        title="Guide",
        text="\n\n".join(f"Paragraph {i} mentions Napoli and Sicily at length." * 4 for i in range(6)),
        event_time=T0,
    )
    outcome = await service(store, llm, embedder, document_chunk_chars=400).memorize([doc])
    stats = await store.stats("u1")
    assert stats.vertices["episodic"] >= 3 and outcome.updates[0].source_event_ids == ["d1"]


async def test_users_never_share_memory(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Alice keeps her secret in Zurich.", subject="Alice", obj="Zurich")))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "My secret is kept in Zurich.", user="alice", speaker="Alice")])
    llm.queue("extract", reply(fact("Bob keeps his secret in Zurich.", subject="Bob", obj="Zurich")))
    llm.responders["resolve"] = lambda request: pytest.fail("alice's thesis was offered for bob's fact")
    await svc.memorize([msg(2, "My secret is kept in Zurich.", user="bob", speaker="Bob")])
    assert (await store.stats("bob")).vertices.get("thesis", 0) == 1
    assert ids.object_id("alice", "Zurich") != ids.object_id("bob", "Zurich")


async def test_vertices_in_the_graph_without_vectors_get_indexed(store, embedder) -> None:
    """A remote store may hold a crashed write's graph rows without their vectors: the next write indexes them."""
    paris = ids.object_id("u1", "Paris")
    orphan = Vertex(id=paris, user_id="u1", kind=VertexKind.OBJECT, name="Paris")
    await store.apply(ChangeSet(id="c-orphan", user_id="u1", event_ids=["crashed"], vertices=[orphan]), [])
    assert await store.get_vectors("u1", [paris]) == {}
    llm = ScriptedLLM()
    llm.queue("extract", reply(fact("Anna lives in Paris.", relation="lives in", obj="Paris")))
    await service(store, llm, embedder).memorize([msg(1, "I live in Paris.")])
    assert paris in await store.get_vectors("u1", [paris])


async def test_a_value_the_store_rejects_is_dead_lettered_alone(store, embedder, monkeypatch) -> None:
    """A store failure caused by one event's data (the store refuses its change set) costs only that event."""
    apply = store.apply

    async def refusing(change_set: ChangeSet, vectors: list[Any]) -> Any:
        if "m3" in change_set.event_ids:
            raise ValueError("value out of range for the store")
        return await apply(change_set, vectors)

    monkeypatch.setattr(store, "apply", refusing)
    events = [msg(n, f"Hello number {n} from Madrid.") for n in range(1, 6)]
    outcome = await service(store, ScriptedLLM(dict(MEMORIZE_RULES)), embedder).memorize(events, source_topic="chat")
    assert [(d.reason, d.failed_event_ids) for d in outcome.dead_letters] == [("store_failed", ["m3"])]
    assert sorted(e for u in outcome.updates for e in u.source_event_ids) == ["m1", "m2", "m4", "m5"]
    assert await store.seen_events("u1", [f"m{n}" for n in range(1, 6)]) == {"m1", "m2", "m4", "m5"}
