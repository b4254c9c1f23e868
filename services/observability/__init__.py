"""Observability: log context, per-query traces assembled from the stage topic, consumer lag."""
