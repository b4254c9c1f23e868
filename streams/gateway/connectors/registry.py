"""The connectors the settings configure: a platform without its secret has no route (its requests get 404)."""

from __future__ import annotations

from services.settings import Settings
from streams.gateway.connectors.base import Connector
from streams.gateway.connectors.slack import SlackConnector
from streams.gateway.connectors.telegram import TelegramConnector
from streams.gateway.connectors.webhook import WebhookConnector


def configured(settings: Settings) -> dict[str, Connector]:
    """Route path (under /v1/connectors/) -> connector."""
    found: dict[str, Connector] = {}
    window = settings.connector_replay_window_s
    if settings.slack_signing_secret is not None:
        secret = settings.slack_signing_secret.get_secret_value()
        found["slack/events"] = SlackConnector(secret, settings.slack_user, settings.slack_workspaces, window)
    if settings.telegram_secret_token is not None:
        token = settings.telegram_secret_token.get_secret_value()
        found["telegram"] = TelegramConnector(token, settings.telegram_user, settings.telegram_chats)
    if settings.webhook_secret is not None:
        if not settings.webhook_user:
            raise ValueError("MEMSTREAM_WEBHOOK_SECRET needs MEMSTREAM_WEBHOOK_USER: whose memory its messages join")
        found["webhook"] = WebhookConnector(settings.webhook_secret.get_secret_value(), settings.webhook_user, window)
    return found
