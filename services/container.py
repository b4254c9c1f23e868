"""Composition root: builds the store, models and services from settings. The only place that picks adapters."""

from __future__ import annotations

from dataclasses import dataclass

from services.llm.factory import build_embedder, build_llm
from services.llm.scripted import load_scripted_llm
from services.memorize.forget import ForgetService
from services.memorize.service import MemorizeService
from services.ports import LLM, Embedder, Stores
from services.qa.base import QAConfig
from services.qa.fast import FastQA
from services.qa.planning import PlanningQA
from services.qa.service import QAEngine, QAService
from services.qa.simple import SimpleQA
from services.retrieval.registry import get_retriever
from services.settings import Settings


@dataclass
class Services:
    settings: Settings
    stores: Stores
    llm: LLM
    embedder: Embedder
    memorize: MemorizeService
    forget: ForgetService
    qa: QAService

    async def close(self) -> None:
        await self.llm.close()
        await self.embedder.close()
        await self.stores.close()


async def open_stores(settings: Settings, dim: int) -> Stores:
    """The configured backend's stores: ``MEMSTREAM_STORE=sqlite`` (embedded file) or ``remote`` (Dgraph +
    Weaviate)."""
    if settings.store == "remote":
        from services.adapters.remote import RemoteMemoryStore

        return (await RemoteMemoryStore.from_settings(settings, dim)).stores()
    from services.adapters.sqlite import SqliteMemoryStore, StoreDimensionError

    try:
        return SqliteMemoryStore(settings.store_path, dim=dim).stores()
    except StoreDimensionError as exc:
        raise StoreDimensionError(
            f"{exc}: {settings.store_path} holds vectors of another embedder than MEMSTREAM_EMBEDDER="
            f"{settings.embedder}; start with the embedder it was built with, or another MEMSTREAM_DATA_DIR"
        ) from exc


async def build_services(settings: Settings, llm: LLM | None = None) -> Services:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    embedder = build_embedder(settings)
    stores = await open_stores(settings, embedder.dim)
    if llm is None:
        if settings.llm == "scripted":
            if not settings.scripted_llm:
                raise ValueError("MEMSTREAM_LLM=scripted needs MEMSTREAM_SCRIPTED_LLM='module:function'")
            llm = build_llm(settings, cache=stores.cache, inner=load_scripted_llm(settings.scripted_llm))
        else:
            llm = build_llm(settings, cache=stores.cache)
    memorize = MemorizeService(stores, llm, embedder, settings)
    forget = ForgetService(stores.graph, stores.forget, stores.cache, embedder, embeddings=memorize.embedder)
    qa = QAService(build_engine(settings, stores, embedder, llm))
    return Services(settings, stores, llm, embedder, memorize, forget, qa)


def build_engine(settings: Settings, stores: Stores, embedder: Embedder, llm: LLM) -> QAEngine:
    """The QA engine ``settings.qa_engine`` names, over the graph and vectors of ``stores``."""
    graph, vectors = stores.graph, stores.vectors
    if settings.qa_engine == "simple":
        return SimpleQA(graph, vectors, embedder, llm, top_k=settings.qa_top_k)
    engine = PlanningQA if settings.qa_engine == "planning" else FastQA
    return engine(
        graph,
        vectors,
        embedder,
        llm,
        lambda name: get_retriever(name, graph, vectors, embedder),
        QAConfig.from_settings(settings),
    )
