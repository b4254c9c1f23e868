"""Slack and Telegram into memory and answers back, on this machine, without the platforms.

Starts `memstream up`'s processes (embedded broker, a worker, the gateway) with both connectors configured, and a
local stand-in of the two platforms' Web APIs that prints every call the gateway makes to them. Then, as the
platforms would (signed with the demo's secrets):

1. Slack: Anna says where she works; she edits the message; someone asks @memstream in a thread;
2. Telegram: Ben says where he lives in a group; someone sends `/ask where does Ben live?`.

It prints what memory holds after the edit and the answers as the stand-ins received them, edit by edit.

    python scripts/connectors_demo.py                 # the configured model (default: the local Qwen 1.5B)
    python scripts/connectors_demo.py --scripted      # the rule-based scripted model: seconds, not minutes
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memstream.broker import free_port
from memstream.runtime import Stack
from services.settings import Settings
from streams.gateway.keys import create_key

SLACK_SECRET, SLACK_BOT = "demo-signing-secret", "xoxb-demo"
TELEGRAM_SECRET, TELEGRAM_BOT = "demo-secret-token", "123:demo"
TEAM, CHANNEL, CHAT = "T0DEMO", "C0DEMO", -100777


def stand_in(calls: list[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/slack/api/users.info")
    async def slack_user(user: str) -> Any:  # the gateway names authors whose events carry only their id
        print(f"  [slack] users.info user={user}", flush=True)
        return {"ok": True, "user": {"id": user, "real_name": {"U0ANNA01": "Anna", "U0CLEO02": "Cleo"}.get(user, user)}}

    @app.post("/slack/api/{method}")
    async def slack(method: str, request: Request) -> Any:
        fields = json.loads(await request.body() or b"{}")
        calls.append(f"slack {method}: {fields.get('text')!r}")
        print(f"  [slack] {method} thread={fields.get('thread_ts')} text={fields.get('text')!r}", flush=True)
        return {"ok": True, "channel": fields.get("channel"), "ts": fields.get("ts", "1800000000.000100")}

    @app.post("/telegram/bot{token}/{method}")
    async def telegram(token: str, method: str, request: Request) -> Any:
        if method == "getMe":
            return {"ok": True, "result": {"id": 123, "is_bot": True, "first_name": "Mem", "username": "mem_bot"}}
        raw = await request.body()
        fields = json.loads(raw) if raw.startswith(b"{") else dict(httpx.QueryParams(raw.decode()))
        calls.append(f"telegram {method}: {fields.get('text')!r}")
        print(f"  [telegram] {method} text={fields.get('text')!r}", flush=True)
        message_id = int(fields.get("message_id", 900))
        chat = {"id": int(fields["chat_id"]), "type": "supergroup", "title": "Demo"}
        return {"ok": True, "result": {"message_id": message_id, "date": int(time.time()), "chat": chat}}

    return app


def slack_post(http: httpx.Client, event: dict[str, Any], event_id: str) -> None:
    body = json.dumps({"type": "event_callback", "team_id": TEAM, "event_id": event_id, "event": event}).encode()
    stamp = str(int(time.time()))
    mac = hmac.new(SLACK_SECRET.encode(), f"v0:{stamp}:".encode() + body, hashlib.sha256).hexdigest()
    headers = {"X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": f"v0={mac}", "Content-Type": "application/json"}
    response = http.post("/v1/connectors/slack/events", content=body, headers=headers)
    print(f"slack {event.get('subtype') or event['type']}: {response.status_code} {response.json()}", flush=True)


def telegram_post(http: httpx.Client, update: dict[str, Any]) -> None:
    response = http.post(
        "/v1/connectors/telegram", json=update, headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
    )
    print(f"telegram update {update['update_id']}: {response.status_code} {response.json()}", flush=True)


def wait_for(what: str, done: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: {what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)  # poll interval of a deadline wait


async def theses(settings: Settings) -> list[str]:
    """What memory holds for the demo user, as statements (read from the store while the worker runs)."""
    from services.adapters.minilm import MiniLMEmbedder
    from services.adapters.sqlite import SqliteMemoryStore

    async with await SqliteMemoryStore.open(settings.store_path, dim=MiniLMEmbedder.dim) as store:
        return [v.name for v in await store.stores().graph.valid_theses("demo", limit=50)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripted", action="store_true", help="the rule-based scripted model instead")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for each wait")
    args = parser.parse_args()
    calls: list[str] = []
    api_port = free_port()
    server = uvicorn.Server(uvicorn.Config(stand_in(calls), host="127.0.0.1", port=api_port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_for("the stand-in APIs", lambda: server.started, 30)
    api = f"http://127.0.0.1:{api_port}"
    data = Path(tempfile.mkdtemp(prefix="memstream-connectors-demo-"))
    scripted = {"llm": "scripted", "qa_engine": "simple", "scripted_llm": "services.llm.scripted:rule_based_llm"}
    extra: dict[str, Any] = scripted if args.scripted else {}
    settings = Settings(
        data_dir=data,
        port=free_port(),
        slack_signing_secret=SLACK_SECRET,
        slack_user="demo",
        slack_bot_token=SLACK_BOT,
        slack_api_url=f"{api}/slack/api/",
        telegram_secret_token=TELEGRAM_SECRET,
        telegram_user="demo",
        telegram_bot_token=TELEGRAM_BOT,
        telegram_api_url=f"{api}/telegram/bot",
        **extra,
    )
    key = create_key(settings, ["demo"], ["read", "metrics"], label="connectors demo")
    stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=600)
    asyncio.run(stack.start())
    print(f"demo: the stack is up at {stack.url} (logs: {stack.log_dir})", flush=True)
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            said = time.time()
            ts = f"{said:.6f}"
            anna = {"type": "message", "channel": CHANNEL, "user": "U0ANNA01", "ts": ts, "event_ts": ts}
            slack_post(http, {**anna, "text": "I just started my new job as a nurse at St Mary's hospital."}, "Ev1")
            edited = f"{said + 1:.6f}"
            changed = {
                "type": "message", "subtype": "message_changed", "channel": CHANNEL, "ts": edited,
                "message": {**anna, "text": "I just started my new job as a nurse at Mercy hospital.",
                            "edited": {"user": "U0ANNA01", "ts": edited}},
            }  # fmt: skip
            slack_post(http, changed, "Ev2")
            now = int(time.time())
            ben = {"message_id": 11, "from": {"id": 5, "is_bot": False, "first_name": "Ben"}, "date": now}
            group = {"id": CHAT, "type": "supergroup", "title": "Demo"}
            telegram_post(http, {"update_id": 1, "message": {**ben, "chat": group, "text": "I live in Munich now."}})
            stats = lambda: http.get("/v1/stats/demo", headers={"authorization": f"Bearer {key}"}).json()  # noqa: E731
            wait_for("the messages memorized", lambda: stats().get("events", 0) >= 2, args.timeout)
            print(f"demo: memory of 'demo': {stats()}", flush=True)
            for thesis in asyncio.run(theses(settings)):
                print(f"  - {thesis}", flush=True)
            ask_ts = f"{time.time():.6f}"
            mention = {"type": "app_mention", "channel": CHANNEL, "user": "U0CLEO02", "ts": ask_ts, "event_ts": ask_ts}
            slack_post(http, {**mention, "text": "<@UBOT> Where does Anna work now?"}, "Ev3")
            question = {**ben, "message_id": 12, "chat": group, "text": "/ask Where does Ben live?"}
            question["from"] = {"id": 6, "is_bot": False, "first_name": "Cleo"}
            telegram_post(http, {"update_id": 2, "message": question})
            print("demo: answers as the platforms receive them (posted, then edited as they stream):", flush=True)
            auth = {"authorization": f"Bearer {key}"}

            def replied() -> bool:  # the gateway counts an answer posted back once its last edit is done
                lines = [line for line in http.get("/metrics", headers=auth).text.splitlines()
                         if line.startswith("memstream_connector_replies_total{")]  # fmt: skip
                return all(any(f'platform="{p}"' in line for line in lines) for p in ("slack", "telegram"))

            wait_for("both answers", replied, args.timeout)
    finally:
        stack.stop()
        server.should_exit = True
    print("demo: done", flush=True)


if __name__ == "__main__":
    main()
