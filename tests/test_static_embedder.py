"""StaticEmbedder: a token table distilled from the real int8 MiniLM installed from PyPI (once per test module)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.adapters.minilm import MODEL_DISTRIBUTION, installed_file
from services.adapters.static_embedder import DIM, StaticEmbedder
from services.llm.factory import build_embedder
from services.settings import Settings


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def embedder(cache_dir: Path) -> StaticEmbedder:
    embedder = StaticEmbedder(cache_dir)
    embedder.embed_sync(["warm"])  # distils the table (about 16 s on 2 cores)
    assert embedder.distilled
    return embedder


def cos(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b))  # vectors are unit length


async def test_paraphrases_are_closer_than_unrelated(embedder: StaticEmbedder) -> None:
    nurse, hospital, marathon, bread = await embedder.embed(
        [
            "Anna works as a nurse at the hospital.",
            "Anna has a nursing job in a hospital.",
            "Ben is training for the Berlin marathon.",
            "How do I bake sourdough bread?",
        ]
    )
    assert cos(nurse, hospital) > 0.6
    assert cos(nurse, hospital) > cos(nurse, marathon) + 0.3
    assert cos(nurse, hospital) > cos(nurse, bread) + 0.3


async def test_unit_norm_dim_and_order(embedder: StaticEmbedder) -> None:
    texts = ["Alice moved to Berlin in 2021.", "", "Ünïcödé and emoji 🙂 work too", "word " * 1000]
    matrix = np.asarray(await embedder.embed(texts))
    assert matrix.shape == (4, embedder.dim) == (4, DIM)
    np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)  # an empty text too
    single = np.asarray([(await embedder.embed([t]))[0] for t in texts])
    np.testing.assert_allclose(matrix, single, atol=1e-6)


def test_the_kept_table_is_read_not_distilled_again(embedder: StaticEmbedder, cache_dir: Path) -> None:
    again = StaticEmbedder(cache_dir)
    texts = ["Caroline went to the support group.", "Melanie paints sunsets."]
    assert again.embed_sync(texts) == embedder.embed_sync(texts)
    assert not again.distilled
    kept = again.table_path(installed_file(MODEL_DISTRIBUTION, "model.onnx"))
    assert [p.name for p in cache_dir.iterdir()] == [kept.name]  # one file, named by the model's hash and recipe


def test_a_table_of_the_wrong_shape_is_distilled_again(
    embedder: StaticEmbedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = StaticEmbedder(tmp_path)
    path = fresh.table_path(installed_file(MODEL_DISTRIBUTION, "model.onnx"))
    np.save(path, np.zeros((10, DIM), dtype=np.float32))
    # the distillation itself is the module's embedder's (checked above); here only that it is asked for again
    table, _ = embedder._load()
    monkeypatch.setattr("services.adapters.static_embedder.distill", lambda model, size: table)
    assert fresh.embed_sync(["Anna adopted a cat."]) == embedder.embed_sync(["Anna adopted a cat."])
    assert fresh.distilled
    assert np.load(path).shape == table.shape


def test_the_setting_builds_it_beside_the_models(tmp_path: Path) -> None:
    built = build_embedder(Settings(data_dir=tmp_path, embedder="static"))
    assert isinstance(built, StaticEmbedder)
    assert built.cache_dir == tmp_path / "models"
    assert built.dim == 256


async def test_a_memory_built_with_minilm_refuses_the_static_embedder_and_says_why(tmp_path: Path) -> None:
    from services.adapters.sqlite import StoreDimensionError
    from services.container import open_stores

    built = await open_stores(Settings(data_dir=tmp_path, store="sqlite", embedder="minilm"), 384)
    await built.close()
    with pytest.raises(StoreDimensionError, match="MEMSTREAM_EMBEDDER=static") as caught:
        await open_stores(Settings(data_dir=tmp_path, store="sqlite", embedder="static"), DIM)
    assert "dim=384" in str(caught.value) and str(tmp_path) in str(caught.value)
