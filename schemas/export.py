"""Write the JSON Schema of every event contract to schemas/json/ (``python -m schemas.export``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from schemas.events import CONTRACTS

JSON_DIR = Path(__file__).with_name("json")


def render() -> dict[str, str]:
    return {
        f"{name}.schema.json": json.dumps(model.model_json_schema(mode="serialization"), indent=2, sort_keys=True)
        + "\n"
        for name, model in CONTRACTS.items()
    }


def main() -> int:
    JSON_DIR.mkdir(exist_ok=True)
    for filename, text in render().items():
        (JSON_DIR / filename).write_text(text)
    sys.stdout.write(f"wrote {len(CONTRACTS)} schemas to {JSON_DIR}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
