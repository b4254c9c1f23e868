"""Build the configured LLM (with its layers) and embedder from ``Settings``.

Adapters are imported on demand, so a process that uses Ollama never loads llama.cpp and vice versa.
"""

from __future__ import annotations

from pathlib import Path

from services.llm.layers import CachedLLM, LimitedLLM, MeteredLLM, RetryingLLM
from services.llm.scripted import ScriptedLLM, load_scripted_llm
from services.logging import get_logger
from services.ports import LLM, Embedder, KeyValueCache
from services.settings import Settings

log = get_logger(__name__)

#: Output sizes of the Ollama embedding models we know; the stores need the size before the first call.
OLLAMA_EMBED_DIMS = {"all-minilm": 384, "nomic-embed-text": 768, "mxbai-embed-large": 1024, "bge-m3": 1024}


def local_model_path(settings: Settings) -> Path:
    """The GGUF to load: ``llm_model_path`` if set, else the registry model assembled under ``data_dir``."""
    if settings.llm_model_path is not None:
        return settings.llm_model_path
    from services.adapters.llamacpp.weights import ensure_model

    return ensure_model(settings.llm_model, settings.data_dir / "models")


def build_adapter(settings: Settings) -> LLM:
    """The bare model adapter named by ``settings.llm`` (blocking: may assemble the local weights)."""
    if settings.llm == "local":
        from services.adapters.llamacpp import LlamaCppLLM
        from services.adapters.llamacpp.weights import ensure_model

        path = local_model_path(settings)
        return LlamaCppLLM(
            path,
            model=settings.llm_model if settings.llm_model_path is None else path.stem,
            n_ctx=settings.llm_context,
            n_parallel=settings.llm_max_concurrency,
            n_threads=settings.llm_threads,
            stall_timeout_s=settings.llm_stall_timeout_s,
            speculative=settings.llm_speculative,
            draft_path=(
                ensure_model(settings.llm_draft_model, settings.data_dir / "models")
                if settings.llm_speculative == "draft"
                else None
            ),
        )
    if settings.llm == "ollama":
        from services.adapters.ollama import OllamaLLM

        return OllamaLLM(
            settings.llm_model,
            host=settings.ollama_host,
            stall_timeout_s=settings.llm_stall_timeout_s,
            num_ctx=settings.llm_context,
        )
    if settings.llm == "scripted":
        if settings.scripted_llm:
            return load_scripted_llm(settings.scripted_llm)
        return ScriptedLLM()  # answers nothing until a test queues replies
    raise ValueError(f"unknown llm {settings.llm!r}")


def build_llm(settings: Settings, cache: KeyValueCache | None = None, *, inner: LLM | None = None) -> MeteredLLM:
    """Metered(Cached(Limited(Retrying(inner)))); ``inner`` replaces the configured adapter (tests, benchmarks).

    The cache sits outside the concurrency limit so that a hit never waits for, or holds, a model slot.
    """
    llm: LLM = inner if inner is not None else build_adapter(settings)
    llm = RetryingLLM(
        llm, attempts=settings.llm_retries + 1, timeout_s=settings.llm_timeout_s, outage_s=settings.backend_outage_s
    )
    llm = LimitedLLM(llm, settings.llm_max_concurrency)
    if cache is not None:
        llm = CachedLLM(llm, cache)
    metered = MeteredLLM(llm)
    log.info("llm_built", kind=settings.llm, model=metered.model, cached=cache is not None)
    return metered


def build_embedder(settings: Settings) -> Embedder:
    if settings.embedder == "minilm":
        from services.adapters.minilm import MiniLMEmbedder

        return MiniLMEmbedder()
    if settings.embedder == "static":
        from services.adapters.static_embedder import StaticEmbedder

        return StaticEmbedder(settings.data_dir / "models")
    if settings.embedder == "ollama":
        from services.adapters.ollama import OllamaEmbedder

        base = settings.embed_model.split(":", 1)[0]
        if base not in OLLAMA_EMBED_DIMS:
            raise ValueError(
                f"unknown size of Ollama embedding model {settings.embed_model!r}; known: {OLLAMA_EMBED_DIMS}"
            )
        return OllamaEmbedder(
            settings.embed_model,
            dim=OLLAMA_EMBED_DIMS[base],
            host=settings.ollama_host,
            outage_s=settings.backend_outage_s,
        )
    raise ValueError(f"unknown embedder {settings.embedder!r}")
