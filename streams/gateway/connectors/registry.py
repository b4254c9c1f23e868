"""The connectors the settings configure: a platform without its secret has no route (its requests get 404)."""

from __future__ import annotations

from services.settings import Settings
from streams.gateway.connectors.base import Connector, Places, no_places
from streams.gateway.connectors.replies import Replier, SlackReplier, TelegramReplier
from streams.gateway.connectors.slack import SlackConnector
from streams.gateway.connectors.telegram import TelegramConnector
from streams.gateway.connectors.webhook import WebhookConnector


def configured(settings: Settings, places: Places = no_places) -> dict[str, Connector]:
    """Route path (under /v1/connectors/) -> connector; ``places``: the workspace and chat mappings an admin keeps
    with the API keys."""
    found: dict[str, Connector] = {}
    window = settings.connector_replay_window_s
    if settings.slack_signing_secret is not None:
        secret = settings.slack_signing_secret.get_secret_value()
        found["slack/events"] = SlackConnector(secret, settings.slack_user, settings.slack_workspaces, window, places)
    if settings.telegram_secret_token is not None:
        token = settings.telegram_secret_token.get_secret_value()
        found["telegram"] = TelegramConnector(token, settings.telegram_user, settings.telegram_chats, places)
    if settings.webhook_secret is not None:
        if not settings.webhook_user:
            raise ValueError("MEMSTREAM_WEBHOOK_SECRET needs MEMSTREAM_WEBHOOK_USER: whose memory its messages join")
        found["webhook"] = WebhookConnector(settings.webhook_secret.get_secret_value(), settings.webhook_user, window)
    return found


def configured_repliers(settings: Settings) -> dict[str, Replier]:
    """Platform -> the client that answers questions back (a platform without a bot token answers none)."""
    found: dict[str, Replier] = {}
    if settings.slack_bot_token is not None:
        found["slack"] = SlackReplier(settings.slack_bot_token.get_secret_value(), settings.slack_api_url)
    if settings.telegram_bot_token is not None:
        found["telegram"] = TelegramReplier(settings.telegram_bot_token.get_secret_value(), settings.telegram_api_url)
    return found
