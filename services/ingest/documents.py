"""Documents as people have them (Markdown, HTML, PDF, plain text) as text, cut into parts of a few hundred tokens
that overlap, each a ``Document`` event of the same document id (so forgetting the document forgets every part).

Text comes out with maintained libraries: ``pypdf`` (the text layer; an encrypted or scanned PDF is refused with
the reason), ``beautifulsoup4`` (scripts, styles and page chrome dropped), ``markdown-it-py`` (Markdown rendered,
then read as HTML). Tokens are the MiniLM tokenizer's (the embedder's own), so a part's size is what the embedder
and, roughly, the model read.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Literal

from tokenizers import Tokenizer

from schemas.events import Document
from services.ids import digest

Kind = Literal["text", "markdown", "html", "pdf"]

MEDIA_TYPES: dict[str, Kind] = {
    "text/plain": "text",
    "text/markdown": "markdown",
    "text/x-markdown": "markdown",
    "text/html": "html",
    "application/xhtml+xml": "html",
    "application/pdf": "pdf",
}
SUFFIXES: dict[str, Kind] = {
    ".txt": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".pdf": "pdf",
}
_BLOCKS = ["p", "div", "li", "h1", "h2", "h3", "h4", "h5", "h6", "br", "tr", "pre", "blockquote", "section", "dd", "dt"]
#: page chrome and code that is not what the document says
_NOT_TEXT = ("script", "style", "noscript", "template", "nav", "header", "footer", "aside", "form", "svg", "iframe")


class Unreadable(ValueError):
    """A file whose text cannot be had; the message says why (shown to the user as a 422)."""


def extract(data: bytes, kind: Kind) -> str:
    """The text of a file of ``kind``."""
    if kind == "pdf":
        return _pdf(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"the {kind} file is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if kind == "markdown":
        from markdown_it import MarkdownIt

        return _html(MarkdownIt("commonmark").render(text))
    if kind == "html":
        return _html(text)
    return text


def _pdf(data: bytes) -> str:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise Unreadable("the PDF is encrypted: upload it without a password")
        pages = [page.extract_text() or "" for page in reader.pages]
    except Unreadable:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as exc:
        raise Unreadable(f"the PDF cannot be read: {exc}") from exc
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise Unreadable("the PDF has no text layer (a scan?): memstream reads text, not images")
    return text


def _html(markup: str) -> str:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(markup, "html.parser")
    for tag in soup(list(_NOT_TEXT)):
        tag.decompose()
    root = soup.find("main") or soup.find("article") or soup.body or soup
    for block in root.find_all(_BLOCKS):
        block.append("\n")  # a paragraph ends where its block does; inline tags run on
    blocks = [" ".join(line.split()) for line in root.get_text("").split("\n")]
    return "\n\n".join(b for b in blocks if b)


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    from services.adapters.minilm import TOKENIZER_DISTRIBUTION, installed_file

    tokenizer = Tokenizer.from_file(str(installed_file(TOKENIZER_DISTRIBUTION, "tokenizer.json")))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def token_windows(text: str, size: int, overlap: int) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` tokens, each starting ``overlap`` tokens before the last one ended;
    cut at word boundaries (a token's character offsets), so no word is split."""
    if overlap >= size:
        raise ValueError("the overlap must be smaller than the part")
    offsets = [span for span in _tokenizer().encode(text, add_special_tokens=False).offsets if span[1] > span[0]]
    starts = _word_starts(text, offsets)
    start = 0
    while start < len(offsets):
        end = min(start + size, len(offsets))
        while end < len(offsets) and end - 1 > start and not starts[end]:
            end -= 1  # back to the first token of a word
        piece = text[offsets[start][0] : offsets[end - 1][1]].strip()
        if piece:
            yield piece
        if end >= len(offsets):
            return
        nxt = max(end - overlap, start + 1)
        while nxt > start + 1 and not starts[nxt]:
            nxt -= 1
        start = nxt


def _word_starts(text: str, offsets: list[tuple[int, int]]) -> list[bool]:
    """Per token: whether a word starts with it (the text before it is a space, or it is the first)."""
    return [
        n == 0 or offsets[n - 1][1] < begin or not text[begin - 1].isalnum() for n, (begin, _) in enumerate(offsets)
    ]


@dataclass(frozen=True)
class Upload:
    user_id: str
    document_id: str
    title: str | None
    when: datetime


def document_parts(upload: Upload, text: str, size: int, overlap: int) -> list[Document]:
    """The document as ``Document`` events, one per part, ids from the document, the part and its text: the same
    upload again is the same events (memorized once)."""
    parts = list(token_windows(text, size, overlap))
    if not parts:
        raise Unreadable("the file holds no text")
    return [
        Document(
            event_id=f"d_{digest(upload.user_id, upload.document_id, str(n), part)}",
            user_id=upload.user_id,
            event_time=upload.when,
            document_id=upload.document_id,
            title=(f"{upload.title} ({n + 1}/{len(parts)})" if upload.title and len(parts) > 1 else upload.title),
            text=part,
        )
        for n, part in enumerate(parts)
    ]
