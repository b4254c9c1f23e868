"""An extraction call stops at a fact it already wrote, and the rest of its batch is asked for again."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.llm.layers import CachedLLM, cache_key
from services.llm.scripted import ScriptedLLM
from services.memorize import repeats
from services.memorize.extraction import ExtractionInput, ExtractTask, Item, extract_batch
from services.memorize.service import MemorizeService
from services.ports import LLMMessage, LLMRequest
from services.settings import Settings
from tests.test_llm_layers import DictCache
from tests.test_memorize import msg, sample

T = datetime(2023, 6, 2, tzinfo=UTC)
ITEMS = [
    Item("Anna", "I quit Siemens last week and I adopted a cat called Miso.", T),
    Item("Ben", "Nice! I started a pottery class on Monday.", T),
    Item("Anna", "Cool, I also moved to Berlin in May.", T),
    Item("Ben", "I am off to Rome tomorrow.", T),
]
DATA = ExtractionInput(items=ITEMS)


def fact(text: str, obj: str = "", when: str = "") -> dict[str, str]:
    return {"fact": text, "object": obj, "when": when, "kind": "FACT", "temporal": "DYNAMIC"}


def output(*entries: tuple[str, list[dict[str, str]]]) -> str:
    """A compact output as the engine writes it: labels, facts in order, no spaces."""
    body = {"messages": [{"m": label, "facts": facts} for label, facts in entries]}
    return json.dumps(body, separators=(",", ":"))


QUIT = fact("Anna quit Siemens.", "Siemens", "last week")
CAT = fact("Anna adopted a cat called Miso.", "cat")
POTTERY = fact("Ben started a pottery class.", "pottery class", "on Monday")
BERLIN = fact("Anna moved to Berlin.", "Berlin", "in May")
ROME = fact("Ben is going to Rome.", "Rome", "tomorrow")


def labels(task: ExtractTask, data: ExtractionInput) -> list[str]:
    entries = task.json_schema(data)["properties"]["messages"]["prefixItems"]
    return [entry["properties"]["m"]["const"] for entry in entries]


def test_only_an_exact_copy_is_a_repeat() -> None:
    dog, cat = fact("Caroline's pet is a dog."), fact("Caroline's pet is a cat.")
    text = output(("[1] A: x", [dog, cat]), ("[2] B: y", [fact("caroline's  pet is a DOG")]))
    found = repeats.find(text)
    assert found is not None and found.entry == 1 and found.first_fact
    assert repeats.facts_in(text[: found.fact_at]) == ["Caroline's pet is a dog.", "Caroline's pet is a cat."]
    assert repeats.find(output(("[1] A: x", [dog, cat]))) is None


def test_the_output_is_read_up_to_the_repeat() -> None:
    # a copy under the same message: that message keeps the facts before it
    same = output(("[1] Anna: I quit", [QUIT, CAT, QUIT]), ("[2] Ben: Nice! I started", [POTTERY]))
    assert json.loads(repeats.before_repeat(same)) == {"messages": [{"m": "[1] Anna: I quit", "facts": [QUIT, CAT]}]}
    # a copy as a later message's first fact: that message is left out, to be asked again
    later = output(("[1] Anna: I quit", [QUIT]), ("[2] Ben: Nice!", [QUIT, POTTERY]))
    assert json.loads(repeats.before_repeat(later)) == {"messages": [{"m": "[1] Anna: I quit", "facts": [QUIT]}]}
    # a copy of what an earlier call wrote, as the first fact written: the message stays, with no facts
    first = output(("[3] Anna: Cool, I also", [QUIT]))
    assert json.loads(repeats.before_repeat(first, said=["Anna quit Siemens."])) == {
        "messages": [{"m": "[3] Anna: Cool, I also", "facts": []}]
    }
    # escaped quotes in a sentence are read as the sentence says them
    quoted = fact('Anna named her cat "Miso".')
    assert repeats.find(output(("[1] A: x", [quoted, quoted]))) is not None


def test_the_stop_rule_fires_once_the_copy_is_closed_and_its_key_names_what_was_said() -> None:
    text = output(("[1] Anna: I quit", [QUIT, QUIT]))
    stop = repeats.RepeatStop()
    closing = text.index('"Anna quit Siemens."', text.index("Anna quit Siemens.") + 1) + len('"Anna quit Siemens."')
    assert not stop(text[: closing - 1]) and stop(text[:closing])
    assert repeats.RepeatStop(["a"]).key == repeats.RepeatStop(["A "]).key != repeats.RepeatStop(["b"]).key


def scripted(*replies: str) -> ScriptedLLM:
    llm = ScriptedLLM(piece_chars=3)
    llm.queue("extract", *replies)
    return llm


async def test_a_call_stopped_at_a_copy_is_followed_by_one_for_the_rest_with_the_same_prompt() -> None:
    task = ExtractTask()
    labels_all = labels(task, DATA)
    first = output((labels_all[0], [QUIT, CAT]), (labels_all[1], [POTTERY, QUIT, POTTERY]), (labels_all[2], [BERLIN]))
    rest = output((labels_all[2], [BERLIN]), (labels_all[3], [ROME]))
    llm = scripted(first, rest)
    found, calls = await extract_batch(llm, task, DATA, attempts=1)
    one, two = llm.calls_for("extract")
    assert calls == 2
    assert one.messages == two.messages  # the engine reads nothing again
    assert labels(task, DATA) == labels_all and two.json_schema is not None
    assert [e["properties"]["m"]["const"] for e in two.json_schema["properties"]["messages"]["prefixItems"]] == (
        labels_all[2:]
    )
    assert two.stop_when is not None and one.stop_when is not None and two.stop_when.key != one.stop_when.key
    texts = [[f.text for f in item.facts] for item in found]
    assert texts == [
        ["Anna quit Siemens.", "Anna adopted a cat called Miso."],
        ["Ben started a pottery class."],
        ["Anna moved to Berlin."],
        ["Ben is going to Rome."],
    ]
    assert all(item.answered for item in found)


async def test_the_model_stops_where_the_copy_ends_and_a_message_that_began_with_one_is_asked_again() -> None:
    task = ExtractTask()
    names = labels(task, DATA)
    # message 3 opens with a copy of message 1's fact: the rest of this output is never generated
    first = output((names[0], [QUIT]), (names[1], [POTTERY]), (names[2], [QUIT, BERLIN]), (names[3], [ROME]))
    again = output((names[2], [BERLIN]), (names[3], [ROME]))
    llm = scripted(first, again)
    found, _ = await extract_batch(llm, task, DATA, attempts=1)
    one, two = llm.calls_for("extract")
    assert [e["properties"]["m"]["const"] for e in two.json_schema["properties"]["messages"]["prefixItems"]] == (
        names[2:]
    )
    assert [[f.text for f in item.facts] for item in found] == [
        ["Anna quit Siemens."],
        ["Ben started a pottery class."],
        ["Anna moved to Berlin."],
        ["Ben is going to Rome."],
    ]
    # the first call's stop rule ended its text just after the copy: what followed it was not generated
    assert one.stop_when is not None and one.stop_when(first[: first.index(BERLIN["fact"])])


async def test_without_the_rule_one_call_reads_everything_and_copies_are_dropped_as_before() -> None:
    task = ExtractTask(stop_repeats=False)
    names = labels(task, DATA)
    llm = scripted(output((names[0], [QUIT, QUIT]), (names[1], [POTTERY]), (names[2], [BERLIN]), (names[3], [ROME])))
    found, calls = await extract_batch(llm, task, DATA, attempts=1)
    assert calls == 1 and llm.calls_for("extract")[0].stop_when is None
    assert [len(item.facts) for item in found] == [1, 1, 1, 1]


async def test_a_replayed_batch_comes_whole_from_the_cache() -> None:
    """Replays must be identical (exactly-once memorize): every part of a stopped batch is cached under a key that
    holds its stop rule, and a replay makes no call."""
    task = ExtractTask()
    names = labels(task, DATA)
    first = output((names[0], [QUIT, CAT, QUIT]), (names[1], [POTTERY]))
    rest = output((names[1], [POTTERY]), (names[2], [BERLIN]), (names[3], [ROME]))
    inner = scripted(first, rest)
    llm = CachedLLM(inner, DictCache())
    found, calls = await extract_batch(llm, task, DATA, attempts=1)
    again, replayed = await extract_batch(llm, task, DATA, attempts=1)
    assert calls == 2 and replayed == 0 and len(inner.calls_for("extract")) == 2
    assert [[f.text for f in i.facts] for i in again] == [[f.text for f in i.facts] for i in found]


def test_the_cache_key_holds_the_stop_rule() -> None:
    def request(**extra: Any) -> LLMRequest:
        return LLMRequest(task="extract", messages=[LLMMessage(role="user", content="x")], **extra)

    plain, ruled = request(), request(stop_when=repeats.RepeatStop())
    other = request(stop_when=repeats.RepeatStop(["Anna quit Siemens."]))
    assert len({cache_key("m", plain), cache_key("m", ruled), cache_key("m", other)}) == 3


async def test_memorize_stops_at_copies_by_default_and_keeps_every_distinct_fact(tmp_path: Path) -> None:
    store = SqliteMemoryStore(tmp_path / "m.sqlite3", dim=384)
    texts = [item.text for item in ITEMS]
    events = [msg(n, text, speaker=ITEMS[n - 1].speaker or "") for n, text in enumerate(texts, start=1)]
    llm = ScriptedLLM(piece_chars=5)

    def extract(request: LLMRequest) -> str:
        names = [e["properties"]["m"]["const"] for e in request.json_schema["properties"]["messages"]["prefixItems"]]
        facts = {"[1]": [QUIT, CAT, QUIT], "[2]": [POTTERY], "[3]": [BERLIN, BERLIN], "[4]": [ROME]}
        return output(*((name, facts[name.split()[0]]) for name in names))

    llm.responders["extract"] = extract
    llm.responders["resolve"] = lambda request: {"pairs": []}
    stopped = sample("memstream_extraction_repeats_total")
    settings = Settings(data_dir=tmp_path, invalidation_candidates=0)
    try:
        outcome = await MemorizeService(store.stores(), llm, MiniLMEmbedder(), settings).memorize(events)
        assert not outcome.dead_letters and outcome.updates[0].theses_added == 5
        # [1]'s copy stops the first call; the second starts at [2] and stops at [3]'s copy; the third starts at [4]
        assert len(llm.calls_for("extract")) == 3
        assert sample("memstream_extraction_repeats_total") == stopped + 2
    finally:
        await store.close()
