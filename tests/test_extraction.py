"""The extraction task: prompt, schema and parser, against recorded good and malformed model outputs."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime

import pytest

from services import ids
from services.llm.scripted import ScriptedLLM
from services.llm.task import TaskFailed, TaskOutputError, load_json_object, run_task
from services.memorize.chunking import chunk_text
from services.memorize.extraction import ExtractionInput, ExtractTask, Item

T = datetime(2023, 6, 2, tzinfo=UTC)
INPUT = ExtractionInput(items=[Item("Anna", "I moved to Berlin last week.", T), Item("Ben", "Cool!", T)])


def fact(subject: str, text: str, relation: str = "", obj: str = "", when: str = "", **labels: str) -> dict:
    return {
        "subject": subject,
        "fact": text,
        "relation": relation,
        "object": obj,
        "when": when,
        "kind": labels.get("kind", "FACT"),
        "temporal": labels.get("temporal", "DYNAMIC"),
    }


GOOD = {
    "messages": [
        {"m": 1, "facts": [fact("Anna", "Anna moved to Berlin.", "moved to", "Berlin", "last week")]},
        {"m": 2, "facts": []},
    ]
}


def test_parses_valid_output_and_resolves_the_time_words() -> None:
    found = ExtractTask().parse(json.dumps(GOOD), INPUT)
    moved = found[0].facts[0]
    assert (moved.subject, moved.text, moved.object) == ("Anna", "Anna moved to Berlin.", "Berlin")
    assert moved.when is not None and (moved.when.start.isoformat(), moved.when.end.isoformat()) == (
        "2023-05-22",
        "2023-05-28",
    )
    assert found[1].answered and found[1].facts == []


def test_time_words_not_in_the_message_are_replaced_by_the_message_s_own() -> None:
    out = {"messages": [{"m": 1, "facts": [fact("Anna", "Anna moved to Berlin.", when="in 2019")]}, {"m": 2}]}
    when = ExtractTask().parse(json.dumps(out), INPUT)[0].facts[0].when
    assert when is not None and when.text == "last week"  # the model's invented year is not used
    plain = ExtractionInput(items=[Item("Anna", "I moved to Berlin.", T)])
    out = {"messages": [{"m": 1, "facts": [fact("Anna", "Anna moved to Berlin.", when="in 2019")]}]}
    assert ExtractTask().parse(json.dumps(out), plain)[0].facts[0].when is None


def test_an_empty_when_takes_the_time_of_the_sentence_the_fact_comes_from() -> None:
    text = "I lost my job as a banker yesterday. Now I want to open a dance studio."
    items = ExtractionInput(items=[Item("Jon", text, T)])
    out = {
        "messages": [
            {
                "m": 1,
                "facts": [
                    fact("Jon", "Jon lost his job as a banker."),
                    fact("Jon", "Jon wants to open a dance studio."),
                ],
            }
        ]
    }
    lost, studio = ExtractTask().parse(json.dumps(out), items)[0].facts
    assert lost.when is not None and lost.when.start.isoformat() == "2023-06-01"
    assert studio.when is None


def test_a_message_without_an_entry_is_reported_not_dropped() -> None:
    out = {"messages": [{"m": 1, "facts": []}]}
    found = ExtractTask().parse(json.dumps(out), INPUT)
    assert found[0].answered and not found[1].answered


def test_facts_are_rewritten_attributed_and_grounded() -> None:
    items = [
        Item("Caroline", "Hey Mel! Good to see you!", T),
        Item("Melanie", "I'm swamped with the kids and work.", T),
        Item("Caroline", "I went to a support group yesterday.", T),
    ]
    out = {
        "messages": [
            # a neighbour's fact written under a greeting: moved to the message that says it
            {"m": 1, "facts": [fact("Caroline", "Caroline went to a support group.", when="yesterday")]},
            # first person in the text, pronoun subject
            {"m": 2, "facts": [fact("I", "I am swamped with my kids and work.", "is swamped with", "kids")]},
            # the first speaker's fact given to the second speaker, and an unfounded one
            {
                "m": 3,
                "facts": [
                    fact("Melanie", "Melanie went to a support group.", "went to", "support group"),
                    fact("Caroline", "Caroline adopted a parrot named Kiwi.", "adopted", "parrot"),
                ],
            },
        ]
    }
    found = ExtractTask().parse(json.dumps(out), ExtractionInput(items=items))
    assert found[0].facts == []
    assert [f.text for f in found[1].facts] == ["Melanie is swamped with Melanie's kids and work."]
    assert found[1].facts[0].subject == "Melanie"
    texts = {f.text: f for f in found[2].facts}
    assert set(texts) == {"Caroline went to a support group."}  # the two copies are one fact, the parrot is gone
    assert texts["Caroline went to a support group."].subject == "Caroline"
    assert "ungrounded" in found[2].dropped


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"messages": [{"m": 1, "facts": [', "not valid JSON"),  # cut off by the token limit
        ('{"msgs": []}', "schema violation at messages"),
        ('{"messages": [{"m": 3, "facts": []}]}', "do not exist"),
        ('{"messages": [{"m": 1, "facts": [{"subject": "Anna", "fact": "x"}]}]}', "schema violation"),
        ('{"messages": [{"m": 1, "facts": [{"subject": "A", "fact": "Anna is here", "kind": "RUMOUR"}]}]}', "schema"),
        ("[]", "schema violation"),
    ],
)
def test_rejects_malformed_output(text: str, reason: str) -> None:
    with pytest.raises(TaskOutputError, match=reason):
        ExtractTask().parse(text, INPUT)


def test_compact_schema_fixes_one_labelled_entry_per_message_and_bounds_everything() -> None:
    schema = ExtractTask().json_schema(INPUT)
    entries = schema["properties"]["messages"]
    assert entries["minItems"] == entries["maxItems"] == 2
    first = entries["prefixItems"][0]["properties"]
    assert first["m"] == {"const": "[1] Anna: I moved to Berlin last"}
    assert first["facts"]["maxItems"] == 3
    fact = first["facts"]["items"]["properties"]
    assert set(fact) == {"fact", "object", "when", "kind", "temporal"}  # subject and relation: read off the sentence
    assert all("maxLength" in fact[k] for k in ("fact", "object", "when"))
    assert fact["kind"]["enum"] == ["FACT", "OPINION", "PREDICTION"]
    assert fact["temporal"]["enum"] == ["STATIC", "DYNAMIC", "ATEMPORAL"]


def test_lean_schema_puts_the_defaultable_fields_last_and_optional() -> None:
    fact = ExtractTask(lean=True).json_schema(INPUT)["properties"]["messages"]["prefixItems"][0]["properties"]["facts"]
    items = fact["items"]
    # a grammar writes required properties first: the order the model writes is the order given here
    assert list(items["properties"]) == ["fact", "object", "temporal", "when", "kind"]
    assert items["required"] == ["fact", "object", "temporal"]
    assert ExtractTask(lean=True, output="json").lean is False  # the keyed output has no lean form


def test_lean_output_without_when_or_kind_is_a_fact_dated_by_its_message_s_own_time_words() -> None:
    plain = {"fact": "Anna moved to Berlin.", "object": "Berlin", "temporal": "DYNAMIC"}
    for facts, kind in (([plain], "FACT"), ([{**plain, "when": "last week", "kind": "PREDICTION"}], "PREDICTION")):
        text = json.dumps(
            {
                "messages": [
                    {"m": "[1] Anna: I moved to Berlin last", "facts": facts},
                    {"m": "[2] Ben: Cool!", "facts": []},
                ]
            }
        )
        first, _ = ExtractTask(lean=True).parse(text, INPUT)
        (found,) = first.facts
        # left out, "when" is found in the sentence the fact comes from ("last week"), as for an empty one
        assert found.kind == kind and found.when is not None and found.when.start == date(2023, 5, 22)


def test_the_lean_example_is_the_compact_one_without_its_defaults() -> None:
    from services.memorize.extraction import EXAMPLE_OUT_COMPACT, EXAMPLE_OUT_LEAN, SYSTEM_COMPACT, SYSTEM_LEAN

    def facts(text: str) -> list[dict[str, str]]:
        return [f for m in json.loads(text)["messages"] for f in m["facts"]]

    defaults = {"when": "", "kind": "FACT"}
    full = [{k: v for k, v in f.items() if defaults.get(k) != v} for f in facts(EXAMPLE_OUT_COMPACT)]
    assert facts(EXAMPLE_OUT_LEAN) == full
    assert all(list(f)[:3] == ["fact", "object", "temporal"] for f in facts(EXAMPLE_OUT_LEAN))
    assert SYSTEM_LEAN != SYSTEM_COMPACT and "a plain fact has no kind" in SYSTEM_LEAN
    (system, *_), lean = ExtractTask().messages(INPUT), ExtractTask(lean=True).messages(INPUT)
    assert system.content == SYSTEM_COMPACT and lean[0].content == SYSTEM_LEAN and lean[2].content == EXAMPLE_OUT_LEAN


def test_compact_output_reads_subject_and_relation_off_the_sentence() -> None:
    fact = {
        "fact": "I moved to Berlin.",
        "object": "Berlin",
        "when": "last week",
        "kind": "FACT",
        "temporal": "DYNAMIC",
    }
    text = json.dumps(
        {"messages": [{"m": "[1] Anna: I moved to Berlin last", "facts": [fact]}, {"m": "[2] Ben: Cool!", "facts": []}]}
    )
    first, second = ExtractTask().parse(text, INPUT)
    (found,) = first.facts
    assert (found.subject, found.text, found.relation, found.object) == (
        "Anna",
        "Anna moved to Berlin.",
        "moved to",
        "Berlin",
    )
    assert found.when is not None and found.when.start == date(2023, 5, 22) and second.facts == []


@pytest.mark.parametrize(
    ("sentence", "obj", "subject", "relation"),
    [
        ("Ben started a pottery class and loves it.", "pottery class", "Ben", "started"),
        ("Ben's sister is getting married in Rome.", "Rome", "Ben", "sister is getting married in"),
        ("Grandma Rosa gave Anna a necklace.", "necklace", "Grandma Rosa", "gave Anna"),
        ("Anna works as a nurse at St. Mary's.", "St. Mary's", "Anna", "works as a nurse at"),
        ("Melanie is a painter.", "", "Melanie", "is"),
        ("I quit my job.", "job", "I", "quit"),
    ],
)
def test_compact_subject_and_relation(sentence: str, obj: str, subject: str, relation: str) -> None:
    from services.memorize.attribution import Speakers
    from services.memorize.compact import relation_of, subject_of

    found = subject_of(sentence, Speakers(("Anna", "Ben")))
    assert (found, relation_of(sentence, found, obj)) == (subject, relation)


def test_compact_subject_longer_than_a_subject_may_be_is_cut_at_a_word_not_rejected() -> None:
    """A derived field the model does not write must fit the schema: a retry could not mend it."""
    from services.memorize.attribution import Speakers
    from services.memorize.compact import MAX_SUBJECT, subject_of
    from services.memorize.extraction import _labels

    royal = "Infante Antonio Pascual Francisco Javier Juan Nepomuceno Aniello Raimundo Silvestre"
    sentence = f"{royal} of Spain was a Spanish infante."
    assert subject_of(sentence, Speakers(())) == "Infante Antonio Pascual Francisco Javier Juan Nepomuceno"
    assert len(subject_of("X" * 90 + " is a word.", Speakers(()))) == MAX_SUBJECT
    long_name = "Anna " + "B" * 70
    assert subject_of(f"{long_name} moved.", Speakers((long_name,))) == "Anna"  # a speaker's long name, cut too
    # through the whole parse, as memorize runs it on a passage: kept, not rejected
    passage = ExtractionInput(items=[Item("Infante Antonio", sentence, T, document=True)])
    task = ExtractTask()
    (label,) = _labels(passage)
    fact = {"fact": sentence, "object": "Spain", "when": "", "kind": "FACT", "temporal": "STATIC"}
    (found,) = task.parse(json.dumps({"messages": [{"m": label, "facts": [fact]}]}), passage)[0].facts
    assert found.subject == "Infante Antonio Pascual Francisco Javier Juan Nepomuceno"


def test_a_fact_the_sentence_bound_ended_is_kept_marked_and_counted() -> None:
    """Nothing silent: a sentence the grammar stopped at its bound says so on the thesis, the episode and a metric."""
    from prometheus_client import REGISTRY

    from services.memorize.builder import ChangeSetBuilder, Source, fact_of, fact_record
    from services.memorize.compact import MAX_FACT, was_cut
    from services.memorize.extraction import _labels
    from services.memorize.service import _with_outcome

    words = "Sid Haig was an American actor, musician and film producer who appeared in many horror films "
    cut = (words * 3)[:MAX_FACT].rstrip()  # what the grammar lets through: the bound, mid-word
    whole = "Sid Haig was born in Fresno, California."
    assert was_cut(cut) and not was_cut(whole) and not was_cut(cut[:-1] + ".")
    passage = ExtractionInput(items=[Item("Sid Haig", f"{cut} and more. {whole}", T, document=True)])
    (label,) = _labels(passage)
    facts = [{"fact": f, "object": "", "when": "", "kind": "FACT", "temporal": "STATIC"} for f in (cut, whole)]
    (found,) = ExtractTask().parse(json.dumps({"messages": [{"m": label, "facts": facts}]}), passage)
    assert [(f.text, f.cut) for f in found.facts] == [(cut, True), (whole, False)]  # kept as written
    assert [fact_of(fact_record(f)).cut for f in found.facts] == [True, False]  # a replay keeps the mark

    counted = REGISTRY.get_sample_value("memstream_extraction_facts_cut_total") or 0.0
    episode = _with_outcome(Source("d1", 0, passage.items[0].text, T, T, {}), found)
    assert episode.props["facts_cut"] == "1"
    assert REGISTRY.get_sample_value("memstream_extraction_facts_cut_total") == counted + 1
    builder = ChangeSetBuilder("sid", "c", ["d1"])
    cut_id, whole_id = builder.add(episode, found)
    theses = {v.id: v for v in builder.build(0).vertices}
    assert theses[cut_id].props["cut"] == "length" and "cut" not in theses[whole_id].props


@pytest.mark.parametrize("sentence", ["The class starts in June.", "She quit her job.", "It was fun."])
def test_compact_sentence_that_names_nobody_has_a_pronoun_subject(sentence: str) -> None:
    from services.memorize.attribution import Speakers
    from services.memorize.compact import subject_of

    assert subject_of(sentence, Speakers(("Anna", "Ben"))) == "it"  # dropped by the checks, counted


def test_compact_fact_of_the_wrong_shape_is_rejected() -> None:
    text = json.dumps(
        {"messages": [["[1] Anna: I moved to Berlin last", [["Anna moved.", "Berlin"]]], ["[2] Ben: Cool!", []]]}
    )
    with pytest.raises(TaskOutputError):
        ExtractTask().parse(text, INPUT)


def test_keyed_schema_fixes_one_entry_per_message_and_bounds_everything() -> None:
    schema = ExtractTask(output="json").json_schema(INPUT)
    entries = schema["properties"]["messages"]
    assert entries["minItems"] == entries["maxItems"] == 2
    first = entries["prefixItems"][0]["properties"]
    assert first["m"] == {"const": 1} and first["speaker"] == {"const": "Anna"}
    assert first["starts"] == {"const": "I moved to Berlin last"}
    text = json.dumps(schema)
    for label in ("FACT", "OPINION", "PREDICTION", "STATIC", "DYNAMIC", "ATEMPORAL"):
        assert label in text
    fact_schema = schema["$defs"]["FactOut"]["properties"]
    assert all("maxLength" in fact_schema[k] for k in ("subject", "fact", "relation", "object", "when"))
    assert first["facts"]["maxItems"] == 3


def test_prompt_names_speaker_and_date_before_each_message() -> None:
    prompt = ExtractTask().messages(INPUT)[-1].content
    assert "[1] Anna, Friday 2 June 2023: I moved to Berlin last week." in prompt
    assert "[2] Ben, Friday 2 June 2023: Cool!" in prompt
    assert ExtractTask(example=False).messages(INPUT)[0].role == "system"
    assert len(ExtractTask(example=False).messages(INPUT)) == 2


async def test_retries_invalid_output_then_succeeds_with_feedback() -> None:
    llm = ScriptedLLM()
    llm.queue("extract", "{not json", GOOD)
    result = await run_task(llm, ExtractTask(), INPUT, attempts=3)
    assert result.calls == 2
    retry_prompt = llm.calls[1].messages[-1].content
    assert "rejected" in retry_prompt and "not valid JSON" in retry_prompt


async def test_gives_up_after_bounded_attempts() -> None:
    llm = ScriptedLLM()
    llm.queue("extract", "nope", "still nope", "never")
    with pytest.raises(TaskFailed) as info:
        await run_task(llm, ExtractTask(), INPUT, attempts=3)
    assert info.value.attempts == 3 and len(llm.calls) == 3


def test_load_json_object_reports_position() -> None:
    with pytest.raises(TaskOutputError, match="at char"):
        load_json_object('{"a": }')


def test_ids_are_deterministic_per_user_and_normalised() -> None:
    assert ids.object_id("u1", "The  Eiffel_Tower") == ids.object_id("u1", "eiffel tower")
    assert ids.object_id("u1", "Berlin") != ids.object_id("u2", "Berlin")
    assert ids.thesis_id("u1", "Anna moved to Berlin.") == ids.thesis_id("u1", "anna moved to  berlin")
    assert ids.edge_id("u1", "relation", "a", "Lives In", "b") == ids.edge_id("u1", "relation", "a", "lives in", "b")
    assert ids.change_set_id("u", ["b", "a"]) == ids.change_set_id("u", ["a", "b"])


def test_chunking_respects_limits_and_keeps_text() -> None:
    text = "First paragraph. " * 30 + "\n\n" + "Second one is short."
    chunks = chunk_text(text, 200)
    assert all(len(c) <= 200 for c in chunks)
    assert " ".join(chunks).split() == text.split()


def test_the_worked_example_is_valid_output_for_its_own_input() -> None:
    from services.memorize.extraction import EXAMPLE_IN, EXAMPLE_OUT, ExtractionOut, _opening

    lines = EXAMPLE_IN.splitlines()[1:]
    out = json.loads(EXAMPLE_OUT)
    ExtractionOut.model_validate(out)
    assert [m["m"] for m in out["messages"]] == list(range(1, len(lines) + 1))
    for entry, line in zip(out["messages"], lines, strict=True):
        speaker, text = line.split("] ", 1)[1].split(", ", 1)[0], line.split(": ", 1)[1]
        assert (entry["speaker"], entry["starts"]) == (speaker, _opening(text))
    assert sum(not m["facts"] for m in out["messages"]) >= 2  # quiet messages are shown as empty


def test_a_question_is_not_a_fact_and_a_time_dates_only_its_clause() -> None:
    said = datetime(2024, 3, 2, tzinfo=UTC)
    items = [
        Item("Ben", "Congrats Anna! Didn't you work at Siemens before?", said),
        Item("Ben", "Nice! I'm still in Munich, training for the Berlin marathon in September.", said),
    ]
    out = {
        "messages": [
            {"m": 1, "facts": [fact("Ben", "Ben worked at Siemens before.", "worked at", "Siemens")]},
            {
                "m": 2,
                "facts": [
                    fact("Ben", "Ben is still in Munich.", "lives in", "Munich", when="in September"),
                    fact("Ben", "Ben is training for the Berlin marathon.", "training for", "Berlin marathon"),
                ],
            },
        ]
    }
    asked, told = ExtractTask().parse(json.dumps(out), ExtractionInput(items=items))
    assert asked.facts == [] and asked.dropped == ["from_question"]
    munich, marathon = told.facts
    assert munich.when is None  # "in September" dates the training, not where Ben lives
    assert marathon.when is not None and marathon.when.describe() == "September 2024"  # still to come


def test_a_greeting_by_name_does_not_make_a_first_person_fact_the_other_s() -> None:
    items = [
        Item("Gina", "Hi Jon!", T),
        Item("Jon", "Hey Gina! I lost my job as a banker yesterday.", T),
        Item("Gina", "Oh no, Jon, sorry! You will find something better, you're great at dancing.", T),
    ]
    out = {
        "messages": [
            {"m": 1, "facts": []},
            {"m": 2, "facts": [fact("Gina", "Gina lost her job as a banker.", "lost job as", "banker")]},
            {
                "m": 3,
                "facts": [
                    fact("Jon", "Jon is great at dancing.", "is great at", "dancing", kind="OPINION"),
                    fact("Gina", "Gina thanks Jon for the news.", "thanks", "Jon"),
                    fact("It", "It is sad news.", "is", "news"),
                ],
            },
        ]
    }
    _, lost, reply = ExtractTask().parse(json.dumps(out), ExtractionInput(items=items))
    assert [(f.subject, f.text) for f in lost.facts] == [("Jon", "Jon lost her job as a banker.")]
    # "you" is Jon, and "you're great at dancing" is Gina praising him: a pleasantry, not a memory
    assert reply.facts == []
    assert sorted(reply.dropped) == ["compliment", "speech_act", "subject_pronoun"]


def test_praise_of_the_person_spoken_to_is_dropped_but_own_feelings_are_kept() -> None:
    items = [
        Item("Melanie", "You'd be a great counselor! Your empathy will really help people.", T),
        Item("Caroline", "Thanks, Melanie! I'm proud of my painting, it took me a year.", T),
    ]
    out = {
        "messages": [
            {
                "m": 1,
                "facts": [
                    fact("Melanie", "Melanie thinks Caroline is a great counselor.", "thinks", "counselor"),
                    fact("Caroline", "Caroline would be a great counselor.", "would be", "counselor"),
                    fact("Melanie", "Melanie is impressed by Caroline's empathy.", "impressed by", "empathy"),
                ],
            },
            {
                "m": 2,
                "facts": [
                    fact("Caroline", "Caroline is grateful for Melanie's compliment.", "grateful for", "compliment"),
                    fact("Caroline", "Caroline is proud of her painting.", "proud of", "painting"),
                ],
            },
        ]
    }
    praise, own = ExtractTask().parse(json.dumps(out), ExtractionInput(items=items))
    assert praise.facts == [] and sorted(praise.dropped) == ["compliment", "compliment", "speech_act"]
    assert [f.text for f in own.facts] == ["Caroline is proud of her painting."]
    assert own.dropped == ["speech_act"]


def test_praise_given_to_the_speaker_by_mistake_is_dropped_and_me_time_stays_a_word() -> None:
    items = [
        Item("Melanie", "No doubts, Caroline. You have such a caring heart!", T),
        Item("Melanie", "So I'm carving out some me-time each day, and I love my caring team.", T),
    ]
    out = {
        "messages": [
            {"m": 1, "facts": [fact("Melanie", "Melanie has such a caring heart.", "has", "caring heart")]},
            {
                "m": 2,
                "facts": [
                    fact("Melanie", "Melanie carves out some me-time each day.", "carves out", "me-time"),
                    fact("Melanie", "Melanie loves her caring team.", "loves", "team"),
                ],
            },
        ]
    }
    slip, own = ExtractTask().parse(json.dumps(out), ExtractionInput(items=items, participants=("Caroline",)))
    assert slip.facts == [] and slip.dropped == ["compliment"]
    assert [f.text for f in own.facts] == [
        "Melanie carves out some me-time each day.",
        "Melanie loves her caring team.",
    ]


def test_a_fact_written_under_a_reply_goes_to_the_message_that_says_it() -> None:
    items = [
        Item("Jon", "Hey Gina! Lost my job as a banker yesterday, so I'm starting my own business.", T),
        Item("Gina", "Sorry about your job Jon! I also lost my job at Door Dash this month.", T),
    ]
    out = {
        "messages": [
            {"m": 1, "facts": []},
            {
                "m": 2,
                "facts": [
                    # said by Jon, written under Gina's reply, with Gina as its subject
                    fact("Gina", "Gina lost her job as a banker yesterday.", "lost job as", "banker", when="yesterday"),
                    fact("Gina", "Gina lost her job at Door Dash.", "lost job at", "Door Dash"),
                    fact("Gina", "Gina asked Gina about the job.", "asked", "job"),
                ],
            },
        ]
    }
    jon, gina = ExtractTask().parse(json.dumps(out), ExtractionInput(items=items))
    assert [(f.subject, f.text) for f in jon.facts] == [("Jon", "Jon lost her job as a banker yesterday.")]
    assert jon.facts[0].when is not None and jon.facts[0].when.describe() == "1 June 2023"
    assert [(f.subject, f.text) for f in gina.facts] == [("Gina", "Gina lost her job at Door Dash.")]
    assert gina.dropped == ["speech_act"]  # "Gina asked Gina": a rewritten question, not a memory


def test_a_message_s_opening_words_pass_over_a_greeting_to_what_it_tells() -> None:
    from services.memorize.extraction import _opening

    assert _opening("Thanks, Caroline! Painting's a fun way to relax.") == "Painting's a fun way to"
    assert _opening("Hey Caroline! Good to see you! I'm swamped with the kids & work.") == "I'm swamped with the kids"
    assert _opening("Busy! I started a pottery class on Monday.") == "Busy! I started a pottery"  # not a greeting
    # nothing but pleasantries: the message's own first words
    assert _opening("Hey Mel! Good to see you! How have you been?") == "Hey Mel! Good to see"
    assert _opening("I moved to Berlin last week.") == "I moved to Berlin last"
    # a remark on the person spoken to, or a question, tells nothing of the speaker: the news after it does
    told = "Sorry about your job Jon, but your own business sounds awesome! Sadly, I also lost my job at Door Dash."
    assert _opening(told) == "Sadly, I also lost my"
    assert _opening("What jobs are you thinking of? My sister is a nurse.") == "My sister is a nurse."
    assert _opening("Jon got the job! I'm so proud of him.") == "Jon got the job! I'm"  # news of another person


def test_a_document_calling_itself_document_is_its_title() -> None:
    """The input labels a chunk 'document "Title"'; a small model wrote "document has the potential to ..."."""
    title = "The Future of Autonomous Vehicles"
    text = "Autonomous vehicles have the potential to revolutionize transportation by increasing safety."
    titled = ExtractionInput(items=[Item(title, text, T, document=True)])
    said = "document has the potential to revolutionize transportation by increasing safety."
    out = {"messages": [{"m": 1, "facts": [fact("document", said)]}]}
    got = ExtractTask().parse(json.dumps(out), titled)[0].facts[0]
    assert (got.subject, got.text) == (
        title,
        f"{title} has the potential to revolutionize transportation by increasing safety.",
    )
    untitled = ExtractionInput(items=[Item(None, text, T, document=True)])
    assert ExtractTask().parse(json.dumps(out), untitled)[0].facts == []  # no title: nothing it could mean


@pytest.mark.parametrize(("obj", "kept"), [("February", ""), ("last week", ""), ("2023", ""), ("Siemens", "Siemens")])
def test_an_object_that_is_only_a_time_is_no_entity(obj: str, kept: str) -> None:
    """Seen in a new-user trial: "Anna quit Siemens in February" with object "February" made February an entity."""
    from services.memorize.attribution import Speakers, check_fact

    said = "I quit Siemens in February, last week I started at St. Mary's."
    item = Item("Anna", said, datetime(2024, 3, 2, tzinfo=UTC))
    checked = check_fact("Anna", "Anna quit Siemens in February.", "quit", obj, item, Speakers(("Anna", "Ben")))
    assert isinstance(checked, tuple) and checked[2] == kept


def test_lines_grammar_fixes_each_label_once_in_order_and_bounds_every_field() -> None:
    from services.memorize.lines import grammar

    text = grammar(['[1] Anna: I said "hi"', "[2] Ben: a\\b"], 3)
    rules = dict(line.split(" ::= ", 1) for line in text.splitlines())
    assert rules["root"] == "m1 m2"
    assert rules["m1"] == '"[1] Anna: I said \\"hi\\"\\n" fact? fact? fact?'  # a quote in a label is escaped
    assert rules["m2"].startswith('"[2] Ben: a\\\\b\\n"')
    assert rules["sentence"] == "[^|\\n]{8,200}" and rules["object"] == "[^|\\n]{0,60}"
    assert rules["kind"] == '"FACT" | "OPINION" | "PREDICTION"'


def test_lines_output_reads_like_the_compact_one() -> None:
    task = ExtractTask(output="lines")
    text = (
        "[1] Anna: I moved to Berlin last\n- I moved to Berlin. | Berlin | last week | FACT DYNAMIC\n[2] Ben: Cool!\n"
    )
    first, second = task.parse(text, INPUT)
    (found,) = first.facts
    assert (found.subject, found.text, found.relation, found.object, found.temporal) == (
        "Anna",
        "Anna moved to Berlin.",
        "moved to",
        "Berlin",
        "DYNAMIC",
    )
    assert found.when is not None and found.when.start == date(2023, 5, 22) and second.facts == []
    assert task.grammar(INPUT) is not None and task.json_schema(INPUT) is not None  # JSON: scripted, cached


@pytest.mark.parametrize(
    "text",
    [
        "- Anna moved to Berlin. | Berlin | | FACT DYNAMIC\n[1] Anna: I moved to Berlin last\n[2] Ben: Cool!\n",
        "[1] Anna: I moved to Berlin last\n- Anna moved to Berlin. | Berlin\n[2] Ben: Cool!\n",
        "[1] Anna: I moved to Berlin last\n- Anna moved to Berlin. | Berlin | | FACTUAL\n[2] Ben: Cool!\n",
    ],
    ids=["fact-before-any-label", "fields-missing", "unknown-kind"],
)
def test_lines_output_of_the_wrong_shape_is_rejected(text: str) -> None:
    with pytest.raises(TaskOutputError):
        ExtractTask(output="lines").parse(text, INPUT)


async def test_lines_are_asked_with_the_grammar_and_a_retry_names_the_format() -> None:
    good = "[1] Anna: I moved to Berlin last\n- Anna moved to Berlin. | Berlin | | FACT DYNAMIC\n[2] Ben: Cool!\n"
    llm = ScriptedLLM({})
    llm.queue("extract", "[1] Anna: I moved to Berlin last\n- Anna moved. | Berlin\n[2] Ben: Cool!\n", good)
    result = await run_task(llm, ExtractTask(output="lines"), INPUT)
    assert result.calls == 2 and result.value[0].facts[0].object == "Berlin"
    first, retry = llm.calls_for("extract")
    assert first.grammar is not None and first.json_schema is None
    assert "the required format" in retry.messages[-1].content


def test_the_lines_example_is_valid_output_for_its_own_input() -> None:
    from services.memorize.extraction import EXAMPLE_IN, _opening
    from services.memorize.lines import EXAMPLE_OUT_LINES, to_compact

    said = EXAMPLE_IN.splitlines()[1:]
    labels = [
        f"[{n}] {line.split('] ', 1)[1].split(', ', 1)[0]}: {_opening(line.split(': ', 1)[1])}"
        for n, line in enumerate(said, start=1)
    ]
    out = to_compact(EXAMPLE_OUT_LINES, labels)
    assert [m["m"] for m in out["messages"]] == labels
    assert [len(m["facts"]) for m in out["messages"]] == [0, 2, 0, 2, 1]
