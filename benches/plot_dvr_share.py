"""Plot DVR throughput against the deterministic share from `dvr_throughput.py --out` JSON.

    python benches/plot_dvr_share.py dvr-offline.json docs/dvr_share.png

Draws, relative to the 0 % reference of the same run: the default strategy (inline on CPU),
the replay strategy, the `batch_invariant` mode (all requests invariant, drawn at 100 %), the
no-batching baseline, and LLM-42's published ratios (Llama-3.1-8B on an H100, relative to
non-deterministic SGLang) with SGLang's batch-invariant mode for comparison. matplotlib is
needed for this script only (it is not a dependency of detspec).
"""

from __future__ import annotations

import json
import sys

LLM42 = {2: 0.99, 10: 0.96, 50: 0.87, 100: 0.78}
SGLANG_BATCH_INVARIANT = 0.70


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    rows = data["offline"]["rows"]
    inline = sorted(
        (r["share"], r["rel"])
        for r in rows
        if r["mode"] == "dvr"
        and r["label"].startswith("dvr ")
        and "replay" not in r["label"]
        and "again" not in r["label"]
    )
    replay = sorted(
        (r["share"], r["rel"])
        for r in rows
        if r["label"].startswith("dvr replay") and "+" not in r["label"]
    )
    inv = next(r["rel"] for r in rows if r["mode"] == "batch_invariant")
    nob = next(r["rel"] for r in rows if r["label"].startswith("no batching"))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(*zip(*inline, strict=True), "o-", label="detspec dvr, inline (CPU default)")
    ax.plot(*zip(*replay, strict=True), "s--", label="detspec dvr, replay (W=64, B=8)")
    ax.plot([100], [inv], "D", label="detspec batch_invariant")
    ax.plot([100], [nob], "x", markersize=9, label="detspec no batching")
    ax.plot(*zip(*sorted(LLM42.items()), strict=True), "^:", label="LLM-42 (H100, vs SGLang)")
    ax.axhline(SGLANG_BATCH_INVARIANT, color="grey", lw=0.8, ls=":")
    ax.text(1, SGLANG_BATCH_INVARIANT + 0.02, "SGLang batch-invariant (LLM-42 paper)", fontsize=8)
    ax.set_xlabel("deterministic requests (%)")
    ax.set_ylabel("output throughput / 0 % throughput")
    ax.set_ylim(0, 1.3)
    spread = data["offline"]["reference"]["spread"]
    ax.set_title(f"Offline, bench model, 2 CPU cores (0 % runs spread {spread:.0%})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
