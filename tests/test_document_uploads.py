"""Documents as people have them: Markdown, HTML and PDF read with maintained libraries, cut by tokens into parts
that overlap; uploaded to /v1/documents as they are, or sent by `memstream ingest`; unreadable, oversized or
unknown files refused with a clear 4xx."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pypdf import PdfWriter

from memstream.broker import EmbeddedBroker
from schemas.events import Document
from services.ingest.documents import Unreadable, Upload, document_parts, extract, token_windows
from streams.gateway.app import create_app
from streams.topics import TopicNames
from tests.conftest import api_key, make_settings
from tests.test_gateway_forget import run_cli, served


def pdf_with(text: str) -> bytes:
    """A one-page PDF whose text layer says ``text`` (objects written by hand, offsets computed)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % n + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def encrypted_pdf() -> bytes:
    writer = PdfWriter()
    writer.add_blank_page(width=612, height=792)
    writer.encrypt("secret")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


HTML = b"""<!doctype html><html><head><title>t</title><script>track('x')</script><style>p {color: red}</style></head>
<body><nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<main><h1>Team notes</h1><p>Ana moved to <b>Lisbon</b> in May.</p><p>Ben leads the Berlin office.</p></main>
<footer>Copyright 2024</footer></body></html>"""

MARKDOWN = b"""# Trip plan

Ana books the **hotel** in [Porto](https://example.com/porto).

- Ben drives
- Cleo brings the tent
"""


def test_each_kind_reads_as_its_text() -> None:
    assert "Ana moved to Lisbon in May." in extract(HTML, "html")
    assert not any(word in extract(HTML, "html") for word in ("track", "color", "Home", "Copyright"))
    markdown = extract(MARKDOWN, "markdown")
    assert "Ana books the hotel in Porto." in markdown and "Cleo brings the tent" in markdown and "**" not in markdown
    assert "Ana works at Siemens" in extract(pdf_with("Ana works at Siemens"), "pdf")
    with pytest.raises(Unreadable, match="encrypted"):
        extract(encrypted_pdf(), "pdf")
    with pytest.raises(Unreadable, match="cannot be read"):
        extract(b"%PDF-1.4 garbage", "pdf")
    with pytest.raises(Unreadable, match="UTF-8"):
        extract(b"\xff\xfe bad", "html")


def test_parts_are_token_windows_that_overlap_and_repeat_identically() -> None:
    text = " ".join(f"Sentence number {n} tells fact {n}." for n in range(200))
    parts = list(token_windows(text, 100, 20))
    assert len(parts) > 5 and all(len(p.split()) <= 100 for p in parts)
    for before, after in itertools.pairwise(parts):
        assert after.split()[0] in before.split()[-20:]  # each part starts inside the end of the one before
    assert parts[-1].endswith("fact 199.")
    upload = Upload("ana", "doc_1", "Notes", datetime(2024, 5, 1, tzinfo=UTC))
    first = document_parts(upload, text, 100, 20)
    assert [d.event_id for d in first] == [d.event_id for d in document_parts(upload, text, 100, 20)]
    assert {d.document_id for d in first} == {"doc_1"} and first[0].title == f"Notes (1/{len(first)})"


@pytest.mark.server
def test_files_upload_to_documents_as_they_are(tmp_path: Path, broker: EmbeddedBroker) -> None:
    from tests.test_gateway import read_topic

    settings = make_settings(tmp_path / "data", max_body_bytes=64 * 1024)
    key = {"authorization": f"Bearer {api_key(settings, ['ana'], ['write'])}"}
    topic = TopicNames.from_settings(settings).documents
    with TestClient(create_app(settings, broker.bootstrap)) as client:

        def upload(body: bytes, media: str, **params: str) -> object:
            headers = {**key, "content-type": media}
            return client.post("/v1/documents", content=body, headers=headers, params={"user_id": "ana", **params})

        html = upload(HTML, "text/html; charset=utf-8", title="Team notes")
        assert html.status_code == 202 and html.json()["accepted"] == 1
        assert upload(MARKDOWN, "text/markdown").status_code == 202
        assert upload(pdf_with("Ana works at Siemens"), "application/pdf", document_id="cv").status_code == 202
        again = upload(HTML, "text/html", title="Team notes")
        assert again.json()["event_ids"] == html.json()["event_ids"]  # the same file: the same events
        refused = {
            "encrypted": upload(encrypted_pdf(), "application/pdf").status_code,
            "corrupt": upload(b"%PDF-1.4 nothing", "application/pdf").status_code,
            "empty": upload(b"", "text/markdown").status_code,
            "no user": client.post(
                "/v1/documents", content=MARKDOWN, headers={**key, "content-type": "text/markdown"}
            ).status_code,
            "other user": upload(MARKDOWN, "text/markdown", user_id="ben").status_code,
            "too large": upload(b"x" * 70_000, "text/plain").status_code,
            "unknown type": upload(b"PK\x03\x04", "application/zip").status_code,
        }
        assert refused == {
            "encrypted": 422,
            "corrupt": 422,
            "empty": 422,
            "no user": 422,
            "other user": 403,
            "too large": 413,
            "unknown type": 415,
        }
        records = asyncio.run(read_topic(broker.bootstrap, topic, 4))
    documents = [Document.model_validate(json.loads(v)) for _, v in records]
    assert documents[0].title == "Team notes" and "Ana moved to Lisbon in May." in documents[0].text
    assert "Home" not in documents[0].text
    assert documents[2].document_id == "cv" and "Siemens" in documents[2].text


@pytest.mark.server
def test_memstream_ingest_sends_a_file_as_document_parts(tmp_path: Path, broker: EmbeddedBroker) -> None:
    settings = make_settings(tmp_path / "data")
    key = api_key(settings, ["ana"], ["write"])
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\n" + "\n\n".join(f"Fact {n}: Ana visited city number {n}." for n in range(150)))
    with served(create_app(settings, broker.bootstrap)) as url:
        done = run_cli("ingest", str(notes), "--user", "ana", "--url", url, "--key", key)
    assert "in 4 parts" in done.output or " parts for user 'ana'" in done.output
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(encrypted_pdf())
    refused = run_cli("ingest", str(bad), "--user", "ana", "--key", key, code=1)
    assert "encrypted" in refused.output
