#!/usr/bin/env python3
"""benches/README.md's retention tables, from evidence/bench/retention.json (`imcore-load retention`).

Rewrites the text between the `<!-- retention:begin -->` and `<!-- retention:end -->` markers of
benches/README.md; with `--print`, prints it instead. Every figure comes from the JSON.

    python3 benches/load/retention_readme.py [--json evidence/bench/retention.json] [--readme benches/README.md] [--print]
"""

from readme_section import main, ms, n, yes


def ratio(x):
    return "n/a" if x is None else f"{x:.2f}"



def rates(doc):
    out = [
        "Purge rate: one conversation of "
        f"{n(doc['purge_rate'][0]['events_filled'])} old sends per chunk size, purged to the end.",
        "",
        "| chunk | duty | events purged | tombstones | seconds | events/s | tombstones/s | chunk p50 / p99 / max ms | verified |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for p in doc["purge_rate"]:
        out.append(
            f"| {n(p['chunk'])} | {p['duty_pct']}% | {n(p['events_purged'])} | {n(p['tombstones_written'])} | {p['seconds']:.1f} "
            f"| {n(p['events_per_s'])} | {n(p['tombstones_per_s'])} | {ms(p['chunk_ms'])} | {yes(p)} |"
        )
    return out


def under_load(doc):
    h = doc["hot_during_purge"]
    o, s = h["purging_other"], h["purging_itself"]
    out = [
        f"Hot group (C={o['run']['senders']}, `actor`) during a purge with chunk {n(o['purge']['chunk'])} "
        f"at duty {o['purge']['duty_pct']}%, "
        f"each run between two without a purge (its baselines), goal ≥ {h['goal_ratio']:.0%} of their throughput. "
        "The purge runs as long as the hot-group run; `purged` is what it got through meanwhile.",
        "",
        "| run | acked msgs/s | vs baselines | ack p50 / p99 / max ms | purged | chunk p50 / p99 / max ms | verified |",
        "|---|---:|---:|---|---:|---|---|",
    ]

    def part(name, base_name, p):
        b1, b2 = p["baselines"]
        runs = [(f"{base_name} (before)", b1, None), (name, p["run"], p["purge"]), (f"{base_name} (after)", b2, None)]
        for label, run, purge in runs:
            vs = "" if purge is None else f"{p['acked_per_s_over_baseline']:.0%}" + (
                "" if p["meets_goal"] else " (goal missed)"
            )
            purged = "" if purge is None else n(purge["events_purged"])
            chunk = "" if purge is None else ms(purge["chunk_ms"])
            ok = yes(run) if purge is None else ("yes" if run.get("verified") and purge.get("verified") else "**NO**")
            out.append(f"| {label} | {n(run['acked_per_s'])} | {vs} | {ms(run['ack_ms'])} | {purged} | {chunk} | {ok} |")

    part("fresh group, another conversation purged", "fresh group, no purge", o)
    part(
        f"group with {n(s['purge']['events_filled'])} old events, being purged",
        "the same group, no purge",
        s,
    )
    return out


def lookup(doc):
    t = doc["tombstone_lookup"]
    out = [
        "Tombstone probe: sends to two groups with `min_seq` > 1 (every send probes `idem_tombstones`), one "
        f"without tombstones and one with {n(t['conversation_tombstones'])} (the table: {n(t['table_rows'])} rows); "
        "per C the runs go without, with, with, without, and the figures are the means of two runs. The lookup "
        "phase is the mean time of a write transaction's reads under the row lock, the probe among them.",
        "",
        "| C | acked msgs/s without / with | ratio | ack p50 ms without / with | ratio | ack p99 ms without / with | ratio "
        "| txn lookup phase ms without / with | ratio | verified |",
        "|---:|---|---:|---|---:|---|---:|---|---:|---|",
    ]
    for p in t["pairs"]:
        ok = "yes" if all(r.get("verified") for r in p["without"] + p["with"]) else "**NO**"

        def pair(key, fmt):
            return " / ".join(fmt(p[key][k]) for k in ("without", "with"))

        one = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
        two = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        out.append(
            f"| {p['senders']} | {pair('acked_per_s', n)} | {ratio(p['acked_per_s_ratio'])} "
            f"| {pair('ack_p50_ms', one)} | {ratio(p['ack_p50_ratio'])} "
            f"| {pair('ack_p99_ms', one)} | {ratio(p['ack_p99_ratio'])} "
            f"| {pair('lookup_phase_ms', two)} | {ratio(p['lookup_phase_ratio'])} | {ok} |"
        )
    return out


def section(doc):
    out = [
        f"Run `{doc['run_id']}` ({doc['date']}, rev {doc['git_rev']}, {doc['seconds']:.0f} s): `{doc['command']}`. "
        f"Verified: {yes(doc)}.",
        "",
    ]
    for table in (rates, under_load, lookup):
        out += table(doc) + [""]
    return out


if __name__ == "__main__":
    main("retention", "evidence/bench/retention.json", section)
