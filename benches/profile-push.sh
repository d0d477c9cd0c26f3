#!/usr/bin/env bash
# Where the server's CPU goes per pushed frame: the push fan-out to 10,000
# online members (one sender, 10 msgs/s, 50 messages), `perf record` of the
# whole machine for 5 s from the moment the generator starts sending,
# then the split by thread and the server's top functions with call chains.
# Usage: benches/profile-push.sh OUT.txt [SERVER_BIN]  (default: this build's);
# the run's fanout.json lands beside OUT.txt (KEEP=1: its perf.data too). Needs `perf` (Debian
# `linux-perf`) and root; run after `cargo build --release --workspace --bins`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
bin=${2:-target/release/imcore}
members=${MEMBERS:-10000}
work=$(mktemp -d)
chmod 755 "$work" # the embedded PostgreSQL runs as `postgres` when this runs as root
target/release/imcore-load ws --scenarios fanout --fanout-modes push --fanout-members "$members" \
    --server-bin "$bin" --data-dir "$work/data" --out-dir "$work" >"$work/load.log" 2>&1 &
load=$!
touch "$work/load.log"
until grep -q '^server ' "$work/load.log"; do
    kill -0 "$load" 2>/dev/null || { cat "$work/load.log"; exit 1; }
    sleep 0.2
done
server=$(sed -n 's/^server [^:]*: pid \([0-9]*\).*/\1/p' "$work/load.log" | head -1)
# The sends start once every device is connected and their statement counts are flushed.
until grep -q '^sending: ' "$work/load.log"; do
    kill -0 "$load" 2>/dev/null || { cat "$work/load.log"; exit 1; }
    sleep 0.2
done
perf record -F 499 -g -a -o "$work/perf.data" -- sleep 5 2>"$work/perf.log"
wait "$load"
mkdir -p "$(dirname "$out")"
set +o pipefail # `head` ends `perf report` early
cp "$work/fanout.json" "${out%.txt}.fanout.json"
{
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) rev $(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty), server $bin"
    echo "# perf record -F 499 -g -a, 5 s from the first send: imcore-load ws --scenarios fanout --fanout-modes push --fanout-members $members"
    grep '^fanout' "$work/load.log" | cut -c1-300
    echo
    echo "## Samples by thread name. The server: actix-rt|… (HTTP and WebSocket workers), delivery-… (lanes),"
    echo "## imcore (main thread); PostgreSQL: postgres; the generator: tokio-rt-worker"
    perf report -i "$work/perf.data" --stdio --no-children --sort comm -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -12
    echo
    echo "## The server process (pid $server) by thread"
    perf report -i "$work/perf.data" --stdio --no-children --pid "$server" --sort comm -g none 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -8
    echo
    echo "## The server process, top functions, self time"
    perf report -i "$work/perf.data" --stdio --no-children --pid "$server" --sort dso,sym -g none 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -40
    echo
    echo "## The server's threads by where their time goes (self time by library: the kernel is the socket work)"
    perf report -i "$work/perf.data" --stdio --no-children --pid "$server" --sort comm,dso -g none 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -12
    echo
    echo "## Where a frame's µs go (benches/profile-split.py: the samples' call chains, scaled to the run's server CPU)"
    benches/profile-split.py "$work/perf.data" "$server" \
        "$(grep -o '"server_cpu_s":[0-9.]*' "$work/load.log" | head -1 | cut -d: -f2)" \
        "$(grep -o '"deliveries": *[0-9]*' "$work/fanout.json" | head -1 | grep -o '[0-9]*$')"
    echo
    echo "## The server process, call chains (frame pointers: whole in the kernel, cut short in Rust code)"
    perf report -i "$work/perf.data" --stdio --no-children --pid "$server" --sort sym -g caller,0.5,callee,function,percent --percent-limit 1.5 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | cut -c1-160 | head -300
} >"$out"
[ -n "${KEEP:-}" ] && cp "$work/perf.data" "${out%.txt}.perf.data"
rm -rf "$work"
echo "wrote $out"
