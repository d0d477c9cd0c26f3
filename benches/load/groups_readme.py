#!/usr/bin/env python3
"""benches/README.md's large-groups tables, from evidence/bench/groups.json (`imcore-load ws --scenarios groups`).

Rewrites the text between the `<!-- groups:begin -->` and `<!-- groups:end -->` markers of
benches/README.md; with `--print`, prints it instead. Every figure comes from the JSON.

    python3 benches/load/groups_readme.py [--json evidence/bench/groups.json] [--readme benches/README.md] [--print]
"""

from readme_section import main, ms, n, yes


def invite(r):
    out = [
        f"Invites: {n(r['invited'])} users into one group in {r['calls']} `invite` calls of "
        f"{r['invite_batch']:,} (one in flight): {r['seconds']:.1f} s, {n(r['members_per_s'])} members/s. "
        + (
            f"The server then stayed busy (delivering the join events) for {r['server_busy_after_s']:.0f} s."
            if r["server_quiet"]
            else f"The server was still busy (delivering the join events) when the wait for it ended "
            f"{r['server_busy_after_s']:.0f} s after the last ack."
        )
        + f" Verified: {yes(r)}.",
        "",
        "| members after the call | calls | call p50 / p99 / max ms | members/s |",
        "|---:|---:|---|---:|",
    ]
    for b in r["by_group_size"]:
        out.append(f"| ≤ {n(b['members_up_to'])} | {b['calls']} | {ms(b['call_ms'])} | {n(b['members_per_s'])} |")
    return out


def send(r):
    out = [
        f"Send to the {n(r['members'])}-member group with {n(r['online_devices'])} member devices online: "
        f"{r['messages']} sends one at a time, then a burst of {r['burst']}. Push = send to arrival at a "
        f"device, per (message, device); last device = per message, until every online device had it.",
        "",
        "| sends | ack p50 / p99 ms | push p50 / p99 ms | last device p50 / p99 ms | devices complete | verified |",
        "|---|---|---|---|---|---|",
    ]
    complete = f"{r['devices_complete']}/{r['online_devices']}"
    for name, key in (("closed loop", "closed_loop"), ("burst", "burst_sends")):
        s = r[key]
        out.append(
            f"| {name} | {ms(s['ack_ms'], ('p50', 'p99'))} | {ms(s['push_ms'], ('p50', 'p99'))} "
            f"| {ms(s['last_device_ms'], ('p50', 'p99'))} | {complete} | {yes(r)} |"
        )
    return out


def members(r):
    out = [
        f"`members` at {n(r['members'])} members, page of {r['limit']}, {r['calls_each']} calls each "
        f"(one in flight). Verified: {yes(r)}.",
        "",
        "| call | matching members | p50 / p99 / max ms |",
        "|---|---:|---|",
    ]
    for s in r["search"]:
        out.append(f"| `q={s['q']}` | {n(s['matching'])} | {ms(s['ms'])} |")
    for p in r["paging"]:
        out.append(f"| `after={p['after']}` | | {ms(p['ms'])} |")
    return out


def rss(r):
    big = r["large_group"]
    return [
        f"RSS: {r['groups']} groups of {n(r['members'])} members ({r['member_sets']}), "
        f"{r['messages_per_group']} sends each, on a freshly started server.",
        "",
        "| server RSS before MB | after MB | per group KiB | + the large group | verified |",
        "|---:|---:|---:|---|---|",
        f"| {r['rss_before_mb']:.1f} | {r['rss_after_mb']:.1f} | {n(r['rss_per_group_kib'])} "
        f"| {n(big['rss_added_kib'])} KiB ({n(big['members'])} members) | {yes(r)} |",
    ]


def section(doc):
    runs = {r["scenario"]: r for r in doc["runs"]}
    out = [
        f"Run `{doc['run_id']}` ({doc['date']}, rev {doc['git_rev']}): `{doc['command']}`.",
        "",
    ]
    for name, table in (("groups-invite", invite), ("groups-send", send), ("groups-members", members), ("groups-rss", rss)):
        r = runs.get(name)
        if r is None:
            continue
        if "error" in r:
            out += [f"{name}: failed: {r['error']}", ""]
            continue
        out += table(r) + [""]
    return out


if __name__ == "__main__":
    main("groups", "evidence/bench/groups.json", section)
