"""What every benchmark-table script of the load generator shares: number formats, and the rewrite
of the text between a section's `<!-- name:begin -->` and `<!-- name:end -->` markers in benches/README.md
from an evidence JSON (`--print` prints it instead)."""

import argparse
import json
import re


def ms(p, keys=("p50", "p99", "max")):
    """`p50 / p99 / max` of a percentiles object, `n/a` without samples."""
    if not p or p.get("p50") is None:
        return "n/a"
    return " / ".join(f"{p[k]:.1f}" for k in keys)


def n(x):
    return "n/a" if x is None else f"{x:,.0f}"


def yes(v):
    return "yes" if v.get("verified") is True else "**NO**"


def main(name, default_json, section, with_path=False):
    """Rewrites benches/README.md's `name` section with `section(doc)` (a list of lines) of the JSON;
    `section(doc, path)` with `with_path`, for a section that also reads files beside it."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=default_json)
    ap.add_argument("--readme", default="benches/README.md")
    ap.add_argument("--print", action="store_true")
    a = ap.parse_args()
    with open(a.json) as f:
        doc = json.load(f)
    text = "\n".join([begin, *(section(doc, a.json) if with_path else section(doc)), end])
    if a.print:
        print(text)
        return
    with open(a.readme) as f:
        readme = f.read()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"{a.readme}: no {begin} … {end} section")
    with open(a.readme, "w") as f:
        f.write(pattern.sub(lambda _: text, readme))
