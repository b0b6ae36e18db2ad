"""Draw docs/replay-pulls.png from `kvtier replay --json` outputs at several arrival rates.

    python scripts/replay_pulls_plot.py OUT.png RUN_1x.txt RUN_4x.txt ...

Each RUN file is the stdout of one `kvtier replay ... --json` (its last line is the JSON; its
config carries `rate_scale`). Top: hit rate by tier (gpu, host, disk, remote stacked) per
policy and rate; bottom: mean and p99 TTFT per policy and rate (log scale).
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvtier.client.tools.replay import TIER_COLORS  # noqa: E402


def main(out: str, runs: list[str]) -> None:
    data = []
    for path in runs:
        with open(path) as fh:
            last = fh.read().strip().splitlines()[-1]
        doc = json.loads(last)
        data.append((doc["config"]["rate_scale"], [r for r in doc["rows"] if r["na"] is None]))
    policies = list(dict.fromkeys(r["policy"] for _, rows in data for r in rows))
    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(10, 8.5))
    width = 0.8 / len(data)
    for k, (scale, rows) in enumerate(data):
        by = {r["policy"]: r for r in rows}
        xs = [i + (k - (len(data) - 1) / 2) * width for i in range(len(policies))]
        bottom = [0.0] * len(policies)
        for tier in ("gpu", "host", "disk", "remote"):
            vals = [(by[p]["remote_hit_rate"] if tier == "remote" else by[p]["hit_rate_by_tier"][tier]) or 0.0
                    if p in by else 0.0 for p in policies]
            ax_hit.bar(xs, vals, width * 0.9, bottom=bottom, color=TIER_COLORS[tier],
                       label=tier if k == 0 else None, alpha=1.0 if k == 0 else 0.7)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for x, total in zip(xs, bottom, strict=True):
            ax_hit.text(x, total + 0.01, f"{total:.3f}\n{scale:g}x", ha="center", va="bottom", fontsize=7)
        for metric, marker in (("ttft_mean_s", "o"), ("ttft_p99_s", "^")):
            ax_ttft.plot(xs, [by[p][metric] if p in by else float("nan") for p in policies], marker, markersize=7,
                         linestyle="none", label=f"{metric[5:-2]} TTFT, {scale:g}x arrival rate")
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(range(len(policies)), policies)
        ax.grid(True, axis="y", alpha=0.3)
    ax_hit.set_ylim(0, 1.15)
    ax_hit.set_ylabel("hit rate (share of blocks)")
    ax_hit.set_title("hit rate by tier (left bar of each pair: 1x, right: 4x)")
    ax_hit.legend(fontsize=8, loc="upper left")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (s, log scale)")
    ax_ttft.set_title("mean and p99 time to first token")
    ax_ttft.legend(fontsize=8)
    fig.suptitle("agentic_sessions.jsonl, 8 replicas, gpu 300k / host 2M / disk 8M tokens, 256-token blocks, "
                 "peers at 10 GB/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
