"""Composition root: builds the store, models and services from settings. The only place that picks adapters."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from services.memorize.forget import ForgetService
from services.memorize.service import MemorizeService
from services.ports import LLM, Embedder, ForgetStore, KeyValueCache, MemoryStore
from services.qa.pipeline import PlanningQA, QAConfig
from services.qa.service import QAEngine, QAService
from services.qa.simple import SimpleQA
from services.retrieval.registry import get_retriever
from services.settings import Settings


@dataclass
class Services:
    settings: Settings
    store: MemoryStore
    llm: LLM
    embedder: Embedder
    memorize: MemorizeService
    forget: ForgetService
    qa: QAService

    async def close(self) -> None:
        await self.llm.close()
        await self.embedder.close()
        await self.store.close()


def load_scripted_llm(spec: str) -> LLM:
    """``module:function`` -> the LLM that function returns (tests and demos run workers with a scripted LLM)."""
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr or "make_llm")
    llm: LLM = factory()
    return llm


async def open_store(settings: Settings, dim: int) -> MemoryStore:
    """The configured memory store: ``MEMSTREAM_STORE=sqlite`` (embedded file) or ``remote`` (Dgraph + Weaviate)."""
    if settings.store == "remote":
        from services.adapters.remote import RemoteMemoryStore

        return await RemoteMemoryStore.from_settings(settings, dim)
    from services.adapters.sqlite import SqliteMemoryStore

    return SqliteMemoryStore(settings.store_path, dim=dim)


async def build_services(settings: Settings, llm: LLM | None = None) -> Services:
    from services.llm.factory import build_embedder, build_llm

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    embedder = build_embedder(settings)
    store = await open_store(settings, embedder.dim)
    cache = store if isinstance(store, KeyValueCache) else None
    if llm is None:
        if settings.llm == "scripted":
            if not settings.scripted_llm:
                raise ValueError("MEMSTREAM_LLM=scripted needs MEMSTREAM_SCRIPTED_LLM='module:function'")
            llm = build_llm(settings, cache=cache, inner=load_scripted_llm(settings.scripted_llm))
        else:
            llm = build_llm(settings, cache=cache)
    memorize = MemorizeService(store, llm, embedder, settings)
    if not isinstance(store, ForgetStore):
        raise TypeError(f"{type(store).__name__} cannot forget: it must implement ForgetStore")
    forget = ForgetService(store, store, cache, embedder)
    qa = QAService(build_engine(settings, store, embedder, llm))
    return Services(settings, store, llm, embedder, memorize, forget, qa)


def build_engine(settings: Settings, store: MemoryStore, embedder: Embedder, llm: LLM) -> QAEngine:
    """The QA engine ``settings.qa_engine`` names, over ``store``."""
    if settings.qa_engine == "planning":
        return PlanningQA(
            store,
            store,
            embedder,
            llm,
            lambda name: get_retriever(name, store, store, embedder),
            QAConfig.from_settings(settings),
        )
    return SimpleQA(store, embedder, llm, top_k=settings.qa_top_k)
