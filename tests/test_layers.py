"""The folders show the data flow: schemas (contracts) -> streams (transport) -> services (logic over ports) ->
adapters. Logic never reaches back for the transport: no module under ``services/`` imports the broker clients,
Faust, ``streams`` or the process runtime (``memstream``); no module under ``streams/`` imports ``memstream``. Read
from the source, so a lazy import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRANSPORT = ("streams", "memstream", "aiokafka", "faust", "mode")


def imported(path: Path) -> set[str]:
    """Top-level package of every import in ``path``, wherever it sits in the module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "services").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_services_never_import_the_transport(path: Path) -> None:
    assert not imported(path) & set(TRANSPORT)


@pytest.mark.parametrize("path", sorted((ROOT / "streams").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_transport_never_imports_the_cli_and_process_runtime(path: Path) -> None:
    """``memstream`` (the CLI, `memstream up`'s processes, the embedded broker) sits on top: it starts the
    transport, the transport never reaches up for it (the broker probe lives in ``streams.readiness``)."""
    assert "memstream" not in imported(path)


def test_the_rule_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from streams.topics import TopicNames\n    import aiokafka\n")
    assert imported(module) == {"streams", "aiokafka"}
