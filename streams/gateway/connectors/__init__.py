"""Messaging connectors: Slack, Telegram and a generic signed webhook into memory.

Each platform module verifies a request as its platform documents it and maps its payload to ``Mapped`` memory
operations; ``base`` is the one path they share: verify, map, make edits and deletions memory operations, publish
through the gateway's durable produce, count every outcome.
"""
