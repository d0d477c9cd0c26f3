#!/usr/bin/env bash
# Where the CPU goes in a pull-mode WebSocket hot group (C=256 senders, 4
# receivers, `actor` path): `perf record` of the whole machine (server,
# PostgreSQL and load generator share it) for 6 s of the run, then the split by
# process and the server's top functions. Writes evidence/bench/profile/.
# Needs `perf` (Debian `linux-perf`) and root (or perf_event_paranoid <= 0);
# run after `cargo build --release --workspace --bins`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=evidence/bench/profile
work=$(mktemp -d)
chmod 755 "$work" # the embedded PostgreSQL runs as `postgres` when this runs as root
mkdir -p "$out"
target/release/imcore-load ws --scenarios hot --hot-delivery pull --senders 256 --receivers 4 \
    --write-paths actor --half-senders 0 --data-dir "$work/data" --out-dir "$work" >"$work/load.log" 2>&1 &
load=$!
until grep -q '^server ' "$work/load.log"; do
    kill -0 "$load" 2>/dev/null || { cat "$work/load.log"; exit 1; }
    sleep 0.2
done
server=$(sed -n 's/^server [^:]*: pid \([0-9]*\).*/\1/p' "$work/load.log" | head -1)
sleep 2 # the connections are set up and the sends under way
perf record -F 499 -g -a -o "$work/perf.data" -- sleep 6 2>"$work/perf.log"
wait "$load"
{
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) rev $(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty)"
    echo "# perf record -F 499 -g -a, 6 s of: imcore-load ws --scenarios hot --hot-delivery pull --senders 256 --receivers 4 --write-paths actor"
    grep '^hot-group' "$work/load.log" | cut -c1-200
    echo
    echo "## Samples by thread name. The server: actix-rt|… (HTTP and WebSocket workers, conversation"
    echo "## actors' arbiters), imcore (main thread), delivery-…; PostgreSQL: postgres; the generator: tokio-rt-worker"
    perf report -i "$work/perf.data" --stdio --no-children --sort comm -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -12
    echo
    echo "## The server process (pid $server), top functions, self time"
    perf report -i "$work/perf.data" --stdio --no-children --pid "$server" --sort dso,sym -g none 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -40
} >"$out/ws-hot-pull.txt"
rm -rf "$work"
echo "wrote $out/ws-hot-pull.txt"
