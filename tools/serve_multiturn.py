#!/usr/bin/env python3
"""Multi-turn TTFT of `k3 serve` with the prefix cache's host tier off and on (not part of CI).

Runs the same workload on two servers, `--cache-host-mb 0` and `--cache-host-mb HOST_MB`, each
with a first tier (`--cache-mb`) too small to keep every conversation: CONVERSATIONS chats take
turns in rotation, each turn's prompt extending the previous one by TURN_TOKENS tokens, so by the
time a chat comes back its snapshots have been evicted from the first tier. Reports per server
the median time to the first token of the later turns, the prefix-cache hit rate and the hits
served from the host tier, then the ratio. Every request is sent alone (one client), so the
times are prefill times.

  tools/serve_multiturn.py --k3 build/k3 --model DIR [--cache-mb 8] [--host-mb 1024]
                           [--conversations 16] [--turns 6] [--turn-tokens 192] [-- SERVE_ARGS...]
Arguments after `--` go to both servers (e.g. `--device cuda`). Only 127.0.0.1 is contacted.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import metrics, post  # noqa: E402


def run(args, host_mb, extra):
    cmd = [args.k3, "serve", "--model", args.model, "--port", "0", "--host", "127.0.0.1", "--ctx", str(args.ctx),
           "--cache-block", str(args.block), "--cache-mb", str(args.cache_mb), "--cache-host-mb", str(host_mb)] + extra
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline().strip().rsplit(":", 1)[1])
        with open(os.path.join(args.model, "config.json")) as f:
            cfg = json.load(f)
        vocab = min(500, cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
        rng = random.Random(11)
        chats = [[] for _ in range(args.conversations)]
        later = []
        before = metrics(port)
        for turn in range(args.turns):
            for chat in chats:
                chat += [rng.randrange(1, vocab) for _ in range(args.turn_tokens)]
                st, data, seconds, _ = post(port, {"prompt": chat, "max_tokens": 1, "temperature": 0})
                if st != 200:
                    raise SystemExit(f"request failed ({st}): {data[:200]!r}")
                if turn > 0:
                    later.append(seconds)
        after = metrics(port)
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        return {"ttft_ms": 1e3 * statistics.median(later), "hit_rate": d["k3_prefix_cache_hits_total"] /
                max(d["k3_prefix_cache_lookups_total"], 1), "host_hits": d.get("k3_prefix_cache_host_hits_total", 0),
                "spills": d.get("k3_prefix_cache_spills_total", 0)}
    finally:
        srv.terminate()
        srv.wait(timeout=30)


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3", default="build/k3")
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache-mb", type=float, default=8)
    ap.add_argument("--host-mb", type=float, default=1024)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=192)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.turns * args.turn_tokens >= args.ctx:
        raise SystemExit("--turns x --turn-tokens must stay below --ctx")
    off = run(args, 0, extra)
    on = run(args, args.host_mb, extra)
    print(f"{args.conversations} conversations x {args.turns} turns of {args.turn_tokens} tokens, "
          f"--cache-mb {args.cache_mb:g}, server args {' '.join(extra) or '(none)'}")
    print("| host tier | TTFT p50, turns 2+ | hit rate | host-tier hits | spills |")
    print("|---|---|---|---|---|")
    for name, r in (("off", off), (f"{args.host_mb:g} MB", on)):
        print(f"| {name} | {r['ttft_ms']:.2f} ms | {r['hit_rate']:.2f} | {r['host_hits']:.0f} | {r['spills']:.0f} |")
    print(f"TTFT with the host tier: {off['ttft_ms'] / on['ttft_ms']:.2f}x faster")


if __name__ == "__main__":
    main()
