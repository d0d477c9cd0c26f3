#!/usr/bin/env python3
"""benches/README.md's tables of the end-to-end run (`imcore-load ws`), from evidence/bench/ws-hot-group.json,
fanout.json and connections.json, which that one command writes.

Rewrites the text between the `<!-- ws:begin -->` and `<!-- ws:end -->` markers of benches/README.md;
with `--print`, prints it instead. Every figure comes from the JSON.

    python3 benches/load/ws_readme.py [--json evidence/bench/ws-hot-group.json] [--readme benches/README.md] [--print]

`--json` names the hot-group file; fanout.json and connections.json are read beside it.
"""

import json
import os

from readme_section import main, ms, n, yes


def cores(c):
    return f"{c['server_cores']} / {c['postgres_cores']} / {c['generator_cores']}"


def run_line(what, doc, path):
    return f"{what} (`{path}`, {doc['date']}, rev {doc['git_rev']})"


def hot(doc, path):
    first = doc["runs"][0]
    out = [
        run_line("Hot group", doc, path) + f": one group, C sender connections (each its own device, up to "
        f"{first['window']} sends in flight), {first['receivers']} receiver devices online; every message is pushed "
        "to every online member device except its sender's. `gaps` are pushes the server skipped that the receivers "
        "then fetched by `sync` after the run; `closed` are connections the server closed.",
        "",
        "| scenario | path | C | acked msgs/s | ack p50 / p99 / max ms | delivery p50 / p99 ms | push deliveries/s "
        "| per server core-second | cores: server / PostgreSQL / generator | gaps (synced) | closed | errors "
        "| verified |",
        "|---|---|---:|---:|---|---|---:|---:|---|---|---:|---|---|",
    ]
    for r in doc["runs"]:
        g = r["receiver_gaps"]
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "-"
        out.append(
            f"| {r['scenario']} | {r['write_path']} | {r['senders']} | {n(r['acked_per_s'])} | {ms(r['ack_ms'])} "
            f"| {ms(r['e2e_ms'], ('p50', 'p99'))} | {n(r['push_deliveries_per_s'])} "
            f"| {n(r['push_deliveries_per_server_core_s'])} | {cores(r['cpu'])} "
            f"| {g['gaps']} ({g['messages_synced_after_the_run']}) | {r['connections_closed_by_server']} "
            f"| {errors} | {yes(r)} |"
        )
    ratios = ", ".join(f"C={x['senders']}: {x['actor_over_direct']}×" for x in doc["ratios"])
    p = doc.get("profile") or {}
    out += [
        "",
        f"`actor` / `direct` (acked msgs/s, same run, verified or not): {ratios}. A durable one-row commit, "
        f"probed after each path's runs: {p.get('commit_ms_after_actor')} ms (actor), "
        f"{p.get('commit_ms_after_direct')} ms (direct).",
    ]
    return out


def fanout(doc, path):
    out = [
        "",
        run_line("Fan-out", doc, path) + ": one sender at 10 msgs/s, every member's device online; time until the last "
        "device has the event (pull: until it has synced after the `head` push). PostgreSQL transactions are the "
        "benchmark database's, from the first send until the devices settled.",
        "",
        "| members | mode | last device p50 / p99 ms | deliveries/s | per server core-second "
        "| head pushes → syncs (refused and retried) | PostgreSQL xacts per delivery "
        "| cores: server / PostgreSQL / generator | devices complete | verified |",
        "|---:|---|---|---:|---:|---|---:|---|---|---|",
    ]
    for r in doc["runs"]:
        s = r.get("pull_syncs")
        syncs = f"{n(s['head_pushes'])} → {n(s['syncs'])} ({s['syncs_refused_and_retried']})" if s else "-"
        out.append(
            f"| {n(r['members'])} | {r['delivery_mode']} | {ms(r['last_device_ms'], ('p50', 'p99'))} "
            f"| {n(r['deliveries_per_s'])} | {n(r['deliveries_per_server_core_s'])} | {syncs} "
            f"| {r['pg_xacts_per_delivery']} | {cores(r['cpu'])} | {r['devices_complete']}/{r['online_devices']} "
            f"| {yes(r)} |"
        )
    return out


def connections(doc, path):
    out = [
        "",
        run_line("Connections", doc, path) + ": idle authenticated WebSocket connections, 100 devices per user, opened "
        "256 at a time (the 50,000 and 100,000 stages are capped at 19,600 by the open-file limit).",
        "",
        "| connections | connects/s | server RSS MB | RSS per connection KiB | a group message reached | verified |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for r in doc["runs"]:
        reached = (
            f"{r['devices_reached_once']}/{r['connections']} devices once, in {r['message_last_device_ms']:.0f} ms"
        )
        out.append(
            f"| {n(r['connections'])} | {n(r['connects_per_s'])} | {n(r['server_rss_mb'])} "
            f"| {r['server_rss_per_connection_kib']} | {reached} | {yes(r)} |"
        )
    return out


def section(doc, path):
    def beside(name):
        other = os.path.join(os.path.dirname(path), name)
        with open(other) as f:
            return json.load(f), other

    return hot(doc, path) + fanout(*beside("fanout.json")) + connections(*beside("connections.json"))


if __name__ == "__main__":
    main("ws", "evidence/bench/ws-hot-group.json", section, with_path=True)
