"""The curve of ``benchmarks.qa_scale``: non-LLM time per question against memory size, one line per series.

    python -m benchmarks.qa_scale_plot docs/qa_scale.png LABEL=results.jsonl [LABEL=results.jsonl ...]

Each results file holds ``qa_scale``'s JSON lines (one per size); each LABEL becomes a p50 and a p95 line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    out, series = Path(sys.argv[1]), sys.argv[2:]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for spec in series:
        label, _, path = spec.partition("=")
        lines = Path(path).read_text().splitlines()
        rows = sorted((json.loads(text) for text in lines if text.strip()), key=lambda r: r["triplets"])
        xs = [r["triplets"] for r in rows]
        (line,) = ax.plot(xs, [r["p95_ms"] for r in rows], marker="o", label=f"{label} p95")
        ax.plot(
            xs, [r["p50_ms"] for r in rows], marker=".", linestyle="--", color=line.get_color(), label=f"{label} p50"
        )
    ax.axhline(100, color="grey", linewidth=0.8, linestyle=":", label="target p95 (100 ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("triplets (edges) in the user's memory")
    ax.set_ylabel("non-LLM time per question (ms)")
    ax.set_title("QA without the model (x86_64, 2 cores, shared)")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
