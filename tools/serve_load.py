#!/usr/bin/env python3
"""Bounded load test of `k3 serve` on loopback (not part of CI).

Starts a server, then runs ROUNDS rounds of N concurrent clients for SECONDS each (every loop
bounded in count and time), and reports throughput, p50/p99 latency, errors, the server's
resident memory after each round (growth across rounds), on a shared-prefix workload the
prefix-cache hit rate and the time-to-first-token with and without a cache hit, and on a mixed
workload (multi-turn chats that extend their earlier turns, a long shared system prompt,
repetitive code-like prompts decoded greedily, a few very long prompts among the short ones)
TTFT and the gaps between streamed chunks (p50/p99), the hit rate and the speculation's
acceptance rate; then replays some of the mixed workload's requests alone on the idle server and
counts those whose tokens differ from what they got under load (all are greedy or seeded).

  tools/serve_load.py --k3 build/k3 --model DIR [--clients 16] [--seconds 15] [--rounds 3]
                      [--max-step-tokens 512] [--speculate ngram] [--verify 200]
Only 127.0.0.1 is ever contacted.
"""
import argparse
import http.client
import json
import random
import re
import statistics
import subprocess
import threading
import time


def post(port, body, stream=False, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft = None
    if stream:
        buf = b""
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: ") and ttft is None:
                ttft = time.perf_counter() - t0
            buf += line
            if line.strip() == b"data: [DONE]":
                break
        data = buf
    else:
        data = r.read()
    c.close()
    return r.status, data, time.perf_counter() - t0, ttft


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z0-9_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def run_round(port, clients, seconds, vocab, max_tokens, rng_seed):
    lat, errors, tokens = [], [], [0]
    lock = threading.Lock()
    deadline = time.time() + seconds

    def client(i):
        rng = random.Random(rng_seed * 1000 + i)
        for _ in range(10000):  # bounded
            if time.time() >= deadline:
                break
            body = {"prompt": [rng.randrange(1, vocab) for _ in range(rng.randint(4, 24))],
                    "max_tokens": rng.randint(4, max_tokens), "temperature": 0.8, "seed": rng.randrange(1 << 30),
                    "ignore_eos": True, "stream": rng.random() < 0.5}
            try:
                st, data, dt, _ = post(port, body, stream=body["stream"])
                with lock:
                    if st != 200:
                        errors.append(st)
                    else:
                        lat.append(dt)
                        tokens[0] += body["max_tokens"]
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))
    ths = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.time()
    [t.start() for t in ths]
    [t.join() for t in ths]
    wall = time.time() - t0
    return {"requests": len(lat), "errors": len(errors), "error_examples": errors[:3], "wall_s": wall,
            "req_per_s": len(lat) / wall, "tok_per_s": tokens[0] / wall,
            "p50_s": pct(lat, 50), "p99_s": pct(lat, 99)}


def shared_prefix(port, vocab, prefix_len, n):
    """TTFT of prompts that share a long prefix: the first (cold) vs the later ones (cache hits)."""
    rng = random.Random(5)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    before = metrics(port)
    cold, warm = [], []
    for i in range(n):
        # A fresh prefix every 4 requests gives a cold TTFT sample; the other 3 reuse it.
        if i % 4 == 0:
            prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
        body = {"prompt": prefix + [rng.randrange(1, vocab) for _ in range(8)], "max_tokens": 2, "temperature": 0,
                "stream": True}
        st, _, _, ttft = post(port, body, stream=True)
        assert st == 200
        (cold if i % 4 == 0 else warm).append(ttft)
    after = metrics(port)
    lookups = after["k3_prefix_cache_lookups_total"] - before["k3_prefix_cache_lookups_total"]
    hits = after["k3_prefix_cache_hits_total"] - before["k3_prefix_cache_hits_total"]
    return {"requests": n, "hit_rate": hits / max(lookups, 1), "ttft_cold_ms": 1000 * statistics.median(cold),
            "ttft_hit_ms": 1000 * statistics.median(warm),
            "ttft_gain": statistics.median(cold) / statistics.median(warm)}


def stream_gaps(port, body):
    """(status, TTFT s, gaps between data chunks in s, token ids) of one streamed completion."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    times, ids = [], []
    while True:
        line = r.readline()
        if not line or line.strip() == b"data: [DONE]":
            break
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
            ch = json.loads(line[6:])["choices"]
            if ch:
                ids += ch[0].get("token_ids", [])
    c.close()
    ttft = times[0] - t0 if times else float("nan")
    return r.status, ttft, [b - a for a, b in zip(times, times[1:])], ids


def mixed_traffic(port, clients, seconds, vocab, ctx, record=None):
    """Realistic mixes: multi-turn chats, a shared system prompt, repetitive code, rare long prompts.
    record: a list that receives (body, token ids) of every completed request."""
    before = metrics(port)
    system = [random.Random(1).randrange(1, vocab) for _ in range(min(256, ctx // 4))]
    ttft, gaps, errors, done = [], [], [], [0]
    lock = threading.Lock()
    deadline = time.time() + seconds

    def client(i):
        rng = random.Random(100 + i)
        convo = []
        for _ in range(1000):  # bounded
            if time.time() >= deadline:
                break
            kind = rng.random()
            if kind < 0.35:  # a chat turn extending the earlier ones (their tokens are a cached prefix)
                if len(convo) > ctx // 2:
                    convo = []
                prompt = convo + [rng.randrange(1, vocab) for _ in range(12)]
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.7, "seed": rng.randrange(1 << 30)}
            elif kind < 0.65:  # the shared system prompt and a short question
                body = {"prompt": system + [rng.randrange(1, vocab) for _ in range(8)], "max_tokens": 16,
                        "temperature": 0.0}
            elif kind < 0.95:  # code-like: repeated spans, greedy (speculation drafts from them)
                span = [rng.randrange(1, vocab) for _ in range(6)]
                body = {"prompt": span * 6, "max_tokens": 32, "temperature": 0.0}
            else:  # a rare very long prompt
                body = {"prompt": [rng.randrange(1, vocab) for _ in range(ctx - 40)], "max_tokens": 8,
                        "temperature": 0.0}
            body["ignore_eos"] = True
            try:
                st, t, g, ids = stream_gaps(port, body)
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                if st != 200:
                    errors.append(st)
                    continue
                ttft.append(t)
                gaps.extend(g)
                done[0] += 1
                if record is not None:
                    record.append((body, ids))
            if kind < 0.35:
                convo = body["prompt"] + ids

    ths = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    after = metrics(port)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"requests": done[0], "errors": len(errors), "error_examples": errors[:3],
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "gap_p50_ms": 1e3 * pct(gaps, 50), "gap_p99_ms": 1e3 * pct(gaps, 99),
            "hit_rate": d.get("k3_prefix_cache_hits_total", 0) / max(d.get("k3_prefix_cache_lookups_total", 0), 1),
            "drafted": d.get("k3_speculation_drafted_tokens_total", 0),
            "accepted": d.get("k3_speculation_accepted_tokens_total", 0)}


def replay_alone(port, record, n):
    """Up to n recorded requests again, one at a time on the idle server: (replayed, mismatches).
    Every request is greedy or seeded, so its tokens must not depend on what ran beside it."""
    rng = random.Random(9)
    picks = rng.sample(record, min(n, len(record)))
    bad = []
    for body, ids in picks:
        st, _, _, again = stream_gaps(port, body)
        if st != 200 or again != ids:
            bad.append({"prompt_len": len(body["prompt"]), "temperature": body["temperature"], "status": st,
                        "loaded": ids[:8], "alone": again[:8]})
    return len(picks), bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k3", default="build/k3")
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prefix-len", type=int, default=448)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-step-tokens", type=int, default=512, help="k3 serve --max-step-tokens")
    ap.add_argument("--speculate", default="off", choices=["off", "ngram"], help="k3 serve --speculate")
    ap.add_argument("--verify", type=int, default=200,
                    help="replay this many of the mixed workload's requests alone and compare their tokens (0: off)")
    args = ap.parse_args()
    srv = subprocess.Popen([args.k3, "serve", "--model", args.model, "--port", "0", "--host", "127.0.0.1",
                            "--max-batch", str(args.max_batch), "--ctx", str(args.ctx), "--cache-block", "64",
                            "--max-step-tokens", str(args.max_step_tokens), "--speculate", args.speculate],
                           stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline().strip().rsplit(":", 1)[1])
        with open(f"{args.model}/config.json") as f:  # random prompts stay inside the vocabulary
            cfg = json.load(f)
        vocab = min(500, cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
        rss = [metrics(port)["k3_process_resident_bytes"]]
        print(f"server on 127.0.0.1:{port}, {args.clients} clients x {args.seconds:.0f} s x {args.rounds} rounds")
        for r in range(args.rounds):
            res = run_round(port, args.clients, args.seconds, vocab, args.max_tokens, r)
            m = metrics(port)
            rss.append(m["k3_process_resident_bytes"])
            mean_batch = m["k3_decode_batch_rows_total"] / max(m["k3_decode_steps_total"], 1)
            print(f"round {r + 1}: {res['requests']} requests, {res['errors']} errors {res['error_examples']}, "
                  f"{res['req_per_s']:.1f} req/s, {res['tok_per_s']:.0f} generated tok/s, "
                  f"p50 {res['p50_s'] * 1000:.0f} ms, p99 {res['p99_s'] * 1000:.0f} ms, mean decode batch "
                  f"{mean_batch:.1f}, RSS {rss[-1] / 2**20:.1f} MiB", flush=True)
        print(f"RSS growth: round 1 -> {args.rounds}: {(rss[-1] - rss[1]) / 2**20:+.1f} MiB "
              f"(start {rss[0] / 2**20:.1f} MiB)")
        sp = shared_prefix(port, vocab, args.prefix_len, 16)
        print(f"shared prefix ({args.prefix_len} tokens): hit rate {sp['hit_rate']:.2f}, TTFT cold "
              f"{sp['ttft_cold_ms']:.1f} ms vs cache hit {sp['ttft_hit_ms']:.1f} ms ({sp['ttft_gain']:.1f}x)")
        record = []
        mx = mixed_traffic(port, args.clients, args.seconds, vocab, args.ctx, record)
        acc = f"{mx['accepted'] / mx['drafted']:.0%} of {mx['drafted']:.0f} drafts kept" if mx["drafted"] else "no drafts"
        print(f"mixed traffic: {mx['requests']} requests, {mx['errors']} errors {mx['error_examples']}, TTFT p50 "
              f"{mx['ttft_p50_ms']:.0f} ms p99 {mx['ttft_p99_ms']:.0f} ms, chunk gaps p50 {mx['gap_p50_ms']:.1f} ms "
              f"p99 {mx['gap_p99_ms']:.1f} ms, prefix-cache hit rate {mx['hit_rate']:.2f}, speculation: {acc}")
        if args.verify:
            n, bad = replay_alone(port, record, args.verify)
            print(f"replayed alone: {n} of the mixed workload's {len(record)} requests, {len(bad)} with other tokens "
                  f"than under load {bad[:3]}")
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/health")
        print("health after load:", c.getresponse().read().decode())
    finally:
        srv.terminate()
        srv.wait(timeout=30)


if __name__ == "__main__":
    main()
