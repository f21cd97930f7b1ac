"""The simulator's table, the issue's target check, and the PNG."""

from __future__ import annotations

import statistics
from pathlib import Path

POLICY_LABELS = {"acceptance_aware": "acceptance-aware", "serve_default": "Serve default",
                 "serve_default_at_gate": "default@gate"}


MEDIAN_FIGURES = ("replica_hours", "tpot_p50_ms", "tpot_p99_ms", "ttft_p99_s", "slo_miss_pct", "dropped",
                  "speculating_pct")


def _case(row: dict) -> tuple:
    return row["profile"], row["scale"], row["mix"], row["policy"]


def _by_case(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(_case(r), []).append(r)
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """One row per profile, scale, mix and policy: the median over its seeds of each figure."""
    return [{"profile": p, "scale": sc, "mix": m, "policy": pol, "seeds": len(runs)}
            | {k: round(statistics.median(r[k] for r in runs), 3) for k in MEDIAN_FIGURES}
            for (p, sc, m, pol), runs in _by_case(rows).items()]


def target_check(rows: list[dict]) -> list[dict]:
    """Issue 5's target, per profile and scale: on code edits at most the default's
    replica-hours with TPOT p99 >= 25 % lower; on the non-repetitive mix never worse on both.
    Each seed's run is compared with the default's on the same arrivals; a case is met when
    the median of those ratios is, and `seeds_met` says on how many seeds it held alone."""
    by = {(_case(r), r["seed"]): r for r in rows}
    out = []
    for (profile, scale, mix, policy), runs in sorted(_by_case(rows).items()):
        if policy != "acceptance_aware":
            continue
        default = (profile, scale, mix, "serve_default")
        pairs = [(r, by[(default, r["seed"])]) for r in runs if (default, r["seed"]) in by]
        if not pairs:
            continue
        hours = [ours["replica_hours"] / base["replica_hours"] for ours, base in pairs]
        p99 = [ours["tpot_p99_ms"] / base["tpot_p99_ms"] for ours, base in pairs]
        met = [_meets(mix, h, q) for h, q in zip(hours, p99)]
        hours_ratio, p99_ratio = statistics.median(hours), statistics.median(p99)
        out.append({"profile": profile, "scale": scale, "mix": mix, "seeds": len(pairs),
                    "replica_hours_vs_default": round(hours_ratio, 3), "tpot_p99_vs_default": round(p99_ratio, 3),
                    "replica_hours_vs_default_range": [round(min(hours), 3), round(max(hours), 3)],
                    "tpot_p99_vs_default_range": [round(min(p99), 3), round(max(p99), 3)],
                    "seeds_met": sum(met), "met": _meets(mix, hours_ratio, p99_ratio)})
    return out


def _meets(mix: str, hours_ratio: float, p99_ratio: float) -> bool:
    if mix == "code_edit":
        return hours_ratio <= 1.0 and p99_ratio <= 0.75
    return not (hours_ratio > 1.0 and p99_ratio > 1.0)


def print_table(result: dict) -> None:
    rows = result["summary"]
    print(f"\nacceptance: {result['acceptance_source']}")
    for name, be in result["break_even_acceptance"].items():
        print(f"{name}: {result['profiles'][name]['source']}; break-even acceptance {be}")
    print(f"medians over {rows[0]['seeds'] if rows else 0} seeds")
    head = (f"{'profile':17s} {'scale':>5s} {'mix':15s} {'policy':17s} {'repl-h':>8s} {'TPOT p50':>9s} "
            f"{'TPOT p99':>9s} {'TTFT p99':>9s} {'SLO miss':>9s} {'dropped':>7s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['profile']:17s} {r['scale']:5d} {r['mix']:15s} {POLICY_LABELS[r['policy']]:17s} "
              f"{r['replica_hours']:8.2f} {r['tpot_p50_ms']:7.1f}ms {r['tpot_p99_ms']:7.1f}ms "
              f"{r['ttft_p99_s']:8.1f}s {r['slo_miss_pct']:8.2f}% {r['dropped']:7.0f}")
    print("\ntarget (vs Serve default, median of per-seed ratios): code_edit hours <= 1.0 and p99 <= 0.75;"
          " non_repetitive not worse on both")
    for t in result["target"]:
        lo_h, hi_h = t["replica_hours_vs_default_range"]
        lo_q, hi_q = t["tpot_p99_vs_default_range"]
        print(f"  {t['profile']:17s} {t['scale']:5d} {t['mix']:15s} hours x{t['replica_hours_vs_default']:.3f}"
              f" ({lo_h:.2f}-{hi_h:.2f})  TPOT p99 x{t['tpot_p99_vs_default']:.3f} ({lo_q:.2f}-{hi_q:.2f})"
              f"  {'met' if t['met'] else 'NOT MET'}, {t['seeds_met']}/{t['seeds']} seeds alone")


def write_png(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]
    profiles = sorted({r["profile"] for r in rows})
    policies = list(POLICY_LABELS)
    colors = {"acceptance_aware": "#2a7", "serve_default": "#888", "serve_default_at_gate": "#c84"}
    fig, axes = plt.subplots(3, len(profiles), figsize=(7 * len(profiles), 11), squeeze=False)
    by = {_case(r): r for r in rows}
    for col, profile in enumerate(profiles):
        groups = sorted({(r["scale"], r["mix"]) for r in rows if r["profile"] == profile})
        for row_i, (metric, label) in enumerate((("replica_hours", "replica-hours / Serve default"),
                                                 ("tpot_p99_ms", "TPOT p99 (ms)"))):
            ax = axes[row_i][col]
            for k, policy in enumerate(policies):
                values = []
                for scale, mix in groups:
                    r = by.get((profile, scale, mix, policy))
                    base = by.get((profile, scale, mix, "serve_default"))
                    v = r[metric] if r else float("nan")
                    values.append(v / base[metric] if metric == "replica_hours" and r and base else v)
                ax.bar([g + (k - 1) * 0.27 for g in range(len(groups))], values, 0.27,
                       label=POLICY_LABELS[policy], color=colors[policy])
            ax.set_xticks(range(len(groups)), [f"{s}\n{m}" for s, m in groups], fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{profile}: {label} (median of seeds)")
            if row_i == 0:
                ax.axhline(1.0, color="k", lw=0.8)
                ax.legend(fontsize=8)
        ax = axes[2][col]
        for policy in policies:
            r = next((x for x in result["rows"] if x["profile"] == profile and x["mix"] == "code_edit"
                      and x["policy"] == policy and "timeline" in x), None)
            if r:
                ax.plot([p[0] / 60 for p in r["timeline"]], [p[1] for p in r["timeline"]],
                        label=POLICY_LABELS[policy], color=colors[policy], lw=1)
                scale, seed = r["scale"], r["seed"]
        warmup_min = result.get("scenario_defaults", {}).get("warmup_s", 0) / 60
        if warmup_min:
            ax.axvline(warmup_min, color="k", lw=0.8, ls=":")
            ax.text(warmup_min, ax.get_ylim()[1] * 0.95, " measured from here", fontsize=7, va="top")
        ax.set_xlabel("minutes")
        ax.set_ylabel("replicas (billed)")
        ax.set_title(f"{profile}: replicas over time, code_edit, scale {scale}, seed {seed}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
