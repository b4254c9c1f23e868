"""How every Kafka client of memstream authenticates and encrypts: the aiokafka keyword arguments built from the
settings (``MEMSTREAM_KAFKA_*``), for producers, consumers, admin clients and the bare metadata client alike.

PLAINTEXT (the default) adds nothing, so clients are built exactly as before. SASL_* need a user and a password;
SSL and SASL_SSL get an SSL context from the CA file (and the client certificate and key, for mTLS). The returned
dict holds the password in clear: pass it straight to the client, never log it (``describe`` is what to log).
"""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka.helpers import create_ssl_context

from services.settings import Settings, get_settings

SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
SSL_PROTOCOLS = ("SSL", "SASL_SSL")


class KafkaSecurityError(ValueError):
    """The Kafka security settings do not fit together (a SASL protocol without credentials, say)."""


def kafka_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The client SSL context for SSL and SASL_SSL (server verification against ``kafka_ssl_cafile``, else the
    system's CAs; a client certificate when both cert and key files are set), None otherwise."""
    if settings.kafka_security_protocol not in SSL_PROTOCOLS:
        return None
    if (settings.kafka_ssl_certfile is None) != (settings.kafka_ssl_keyfile is None):
        raise KafkaSecurityError("MEMSTREAM_KAFKA_SSL_CERTFILE and MEMSTREAM_KAFKA_SSL_KEYFILE go together (mTLS)")
    return create_ssl_context(
        cafile=str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None,
        certfile=str(settings.kafka_ssl_certfile) if settings.kafka_ssl_certfile else None,
        keyfile=str(settings.kafka_ssl_keyfile) if settings.kafka_ssl_keyfile else None,
    )


def sasl_credentials(settings: Settings) -> tuple[str, str] | None:
    """(user, password) for the SASL protocols, None for the others."""
    if settings.kafka_security_protocol not in SASL_PROTOCOLS:
        return None
    if not settings.kafka_username or settings.kafka_password is None:
        raise KafkaSecurityError(
            f"MEMSTREAM_KAFKA_SECURITY_PROTOCOL={settings.kafka_security_protocol} needs MEMSTREAM_KAFKA_USERNAME "
            "and MEMSTREAM_KAFKA_PASSWORD (or its secret file)"
        )
    return settings.kafka_username, settings.kafka_password.get_secret_value()


def kafka_client_options(settings: Settings | None = None) -> dict[str, Any]:
    """Keyword arguments for any aiokafka client (``AIOKafkaProducer``, ``AIOKafkaConsumer``,
    ``AIOKafkaAdminClient``, ``AIOKafkaClient``); ``settings`` unset: the process's own (``get_settings``)."""
    settings = settings if settings is not None else get_settings()
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {"security_protocol": protocol}
    context = kafka_ssl_context(settings)
    if context is not None:
        options["ssl_context"] = context
    credentials = sasl_credentials(settings)
    if credentials is not None:
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        options["sasl_plain_username"], options["sasl_plain_password"] = credentials
    return options


def describe(settings: Settings) -> dict[str, Any]:
    """What may be logged about the Kafka security settings: never the password or the key."""
    described: dict[str, Any] = {"security_protocol": settings.kafka_security_protocol}
    if settings.kafka_security_protocol in SASL_PROTOCOLS:
        described.update(sasl_mechanism=settings.kafka_sasl_mechanism, username=settings.kafka_username)
    if settings.kafka_security_protocol in SSL_PROTOCOLS:
        described.update(mtls=settings.kafka_ssl_certfile is not None)
    return described
