#!/usr/bin/env python3
"""benches/README.md's membership-churn table, from two runs of `imcore-load ws --scenarios groups-churn`:
one against the build before (evidence/bench/churn/before) and one after (evidence/bench/churn/after).

Rewrites the text between the `<!-- churn:begin -->` and `<!-- churn:end -->` markers of
benches/README.md; with `--print`, prints it instead. Every figure comes from the JSONs.

    python3 benches/load/churn_readme.py [--json evidence/bench/churn/after/groups-churn.json] [--print]
"""

import json
import os

from readme_section import main, n, yes


def section(after):
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
    with open(os.path.join(path, "evidence/bench/churn/before/groups-churn.json")) as f:
        before = json.load(f)
    out = []
    for label, doc in (("before", before), ("after", after)):
        out.append(f"{label}: run `{doc['run_id']}` ({doc['date']}, load generator rev {doc['git_rev']}), "
                   f"server `{doc['server_bin']}`: `{doc['command']}`.")
        out.append("")
    r0 = after["runs"][0]
    out += [
        f"Bytes each of {r0['online_devices']} online member devices read: one `invite` of "
        f"{n(r0['invite_batch'])} users into a group of {r0['online_devices'] + 1}, and the whole fill to "
        f"{n(r0['members'])} members by such invites. `default` creates the group without `delivery_mode` "
        "(before: `push`; after: `auto`).",
        "",
        "| build | group | one invite: bytes / frames per device | fill: bytes / frames per device | mode after | verified |",
        "|---|---|---:|---:|---|---|",
    ]
    for label, doc in (("before", before), ("after", after)):
        for r in doc["runs"]:
            c = r.get("conversation_after", {})
            mode = c.get("delivery_mode")
            if c.get("delivery_setting"):
                mode = f"{mode} ({c['delivery_setting']})"
            out.append(
                f"| {label} | `{r['delivery_mode']}` | {n(r['one_invite']['bytes_per_device'])} / "
                f"{r['one_invite']['frames_per_device']:.0f} | {n(r['fill']['bytes_per_device'])} / "
                f"{r['fill']['frames_per_device']:.0f} | {mode} | {yes(r)} |"
            )
    return out


if __name__ == "__main__":
    main("churn", "evidence/bench/churn/after/groups-churn.json", section)
