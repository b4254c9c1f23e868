"""What an embedder costs in retrieval: the flat-RAG baseline of ``memstream eval`` (``raw_flat``: every paragraph or
message an episode, the store's hybrid search, lexical and dense fused) with each embedder, recall of the gold
evidence at 5, 10 and 20. No model call.

  python -m benchmarks.embedder_recall --embedder minilm --embedder static [--dataset 2wiki ...]

Datasets (from ``--data-dir``, the shared data): 2wiki (the paragraphs of its 600 questions), hotpotqa and musique
(100 questions each, their corpora), locomo (conv-26 and conv-30, every turn). Prints one JSON line per dataset and
embedder: recall, how long indexing took, texts per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from evaluation.baselines import index_raw
from evaluation.datasets import Dataset, load_2wiki, load_hotpotqa, load_locomo, load_musique
from services.adapters.sqlite.store import SqliteMemoryStore
from services.llm.factory import build_embedder
from services.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
KS = (5, 10, 20)


def loaders(data: Path) -> dict[str, Callable[[], Dataset]]:
    return {
        "2wiki": lambda: load_2wiki(
            data / "2wikimultihopqa" / "questions_dev600.json", data / "2wikimultihopqa" / "corpus.json"
        ),
        "hotpotqa": lambda: load_hotpotqa(data / "hotpotqa" / "hotpotqa_train100_hipporag.json"),
        "musique": lambda: load_musique(data / "musique" / "musique_train100_hipporag.json"),
        "locomo": lambda: load_locomo(data / "locomo" / "locomo_dev7.json", samples={"conv-26", "conv-30"}),
    }


async def measure(dataset: Dataset, embedder_name: str, models: Path) -> dict[str, float]:
    embedder = build_embedder(Settings(_env_file=None, embedder=embedder_name, data_dir=models.parent))  # type: ignore[call-arg]
    await embedder.embed(["warm up"])  # a model's load or a table's distillation is not indexing
    questions = [q for q in dataset.questions if q.evidence]
    recall = dict.fromkeys(KS, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        store = await SqliteMemoryStore.open(Path(tmp) / "raw.sqlite3", dim=embedder.dim)
        try:
            started = time.perf_counter()
            await index_raw(store, embedder, dataset.events, Settings(_env_file=None).document_chunk_chars)  # type: ignore[call-arg]
            seconds = time.perf_counter() - started
            vectors = await embedder.embed([q.text for q in questions])
            for q, vector in zip(questions, vectors, strict=True):
                hits = await store.search(q.user_id, ["episodic"], vector, q.text, k=max(KS))
                found = await store.get_vertices(q.user_id, [h.id for h in hits])
                for k in KS:
                    events = {found[h.id].props.get("event_id") for h in hits[:k] if h.id in found}
                    recall[k] += sum(1 for e in q.evidence if e in events) / len(q.evidence)
        finally:
            await store.close()
    return {
        **{f"recall@{k}": round(recall[k] / len(questions), 3) for k in KS},
        "questions": len(questions),
        "texts": len(dataset.events),
        "index_s": round(seconds, 1),
        "texts_per_s": round(len(dataset.events) / seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embedder", action="append", choices=["minilm", "static"])
    parser.add_argument("--dataset", action="append", choices=["2wiki", "hotpotqa", "musique", "locomo"])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument(
        "--models-dir", type=Path, default=Path("memstream-data/models"), help="where the static table is kept"
    )
    args = parser.parse_args()
    available = loaders(args.data_dir)
    for name in args.dataset or list(available):
        dataset = available[name]()
        for embedder in args.embedder or ["minilm", "static"]:
            result = asyncio.run(measure(dataset, embedder, args.models_dir))
            print(json.dumps({"dataset": name, "embedder": embedder, **result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
