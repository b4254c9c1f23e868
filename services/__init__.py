"""memstream services: memorize, QA and retrieval logic over ports, plus the adapters that implement the ports."""
