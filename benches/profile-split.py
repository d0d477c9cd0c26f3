#!/usr/bin/env python3
"""Splits a server's perf samples by thread (delivery lanes, HTTP/WebSocket
workers) and by where they are (user space; the kernel's socket send; its
loopback delivery into the client's socket, which a real network would not
charge to the server), in µs per delivered frame.
Usage: profile-split.py PERF_DATA SERVER_PID SERVER_CPU_S FRAMES"""
import re
import subprocess
import sys

data, pid, cpu, frames = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
out = subprocess.run(["perf", "script", "-i", data, "--pid", pid, "-F", "comm,ip,sym"],
                     capture_output=True, text=True).stdout
cats, total = {}, 0
for sample in out.split("\n\n"):
    lines = [l.strip() for l in sample.strip().split("\n") if l.strip()]
    if len(lines) < 2:
        continue
    total += 1
    comm, chain, leaf = lines[0], " ".join(lines[1:]), lines[1]
    thread = "lanes" if comm.startswith("delivery") else "workers" if comm.startswith("actix-rt") else "other"
    if re.search(r"net_rx_action|process_backlog|__netif_receive_skb", chain):
        where = "kernel: loopback delivery into the client's socket"
    elif re.search(r"__sys_sendto|tcp_sendmsg", chain):
        where = "kernel: socket send"
    elif "futex" in chain:
        where = "kernel: futex (wakeups)"
    elif "epoll" in chain:
        where = "kernel: epoll"
    elif leaf.startswith("ffffffff"):
        where = "kernel: other"
    else:
        where = "user space"
    cats[(thread, where)] = cats.get((thread, where), 0) + 1
per = cpu / frames * 1e6
print(f"server samples {total}; server CPU {cpu} s for {frames} frames = {per:.2f} µs/frame")
for (thread, where), n in sorted(cats.items(), key=lambda kv: -kv[1]):
    if n / total >= 0.005:
        print(f"  {thread:8s} {where:52s} {100 * n / total:5.1f}%  {per * n / total:5.2f} µs/frame")
