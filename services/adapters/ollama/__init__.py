"""Adapters for an Ollama server: chat completions and embeddings."""

from services.adapters.ollama.embedder import OllamaEmbedder
from services.adapters.ollama.errors import OllamaError, OllamaUnavailable
from services.adapters.ollama.llm import OllamaLLM

__all__ = ["OllamaEmbedder", "OllamaError", "OllamaLLM", "OllamaUnavailable"]
