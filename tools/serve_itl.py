#!/usr/bin/env python3
"""What a long prompt costs the streams already running (not part of CI).

Starts `k3 serve` once per --max-step-tokens setting, opens N streaming requests, and once they
are decoding sends one long prompt. For each setting it prints the streams' gaps between chunks
(p50, p99, max) before the long prompt arrives and while it is being prefilled, and how long that
prefill took (the long request's time to first token). Only 127.0.0.1 is contacted.

  tools/serve_itl.py --k3 build/k3 --model ../shared/fixtures/models/kimi-k3-tiny \\
      [--streams 16] [--long 3000] [--settings 0,64] [-- SERVE_ARGS...]
Arguments after `--` go to every server (e.g. `--device cuda`).
"""
import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time


def start(k3, model, step_tokens, streams, ctx, extra):
    proc = subprocess.Popen([k3, "serve", "--model", model, "--port", "0", "--max-batch", str(streams + 1),
                             "--ctx", str(ctx), "--max-step-tokens", str(step_tokens), "--memory-mb", "4096",
                             "--cache-mb", "0"] + extra, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise SystemExit("the server did not start: " + line)
    return proc, int(line.rsplit(":", 1)[1])


def stream(port, max_tokens, times, stop):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True,
                                                     "ignore_eos": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    buf = b""
    while not stop.is_set():
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: {"):
                times.append(time.perf_counter())
    c.close()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(args, step_tokens):
    proc, port = start(args.k3, args.model, step_tokens, args.streams, args.ctx, args.extra)
    try:
        stop = threading.Event()
        times = [[] for _ in range(args.streams)]
        ths = [threading.Thread(target=stream, args=(port, args.max_tokens, times[i], stop)) for i in range(args.streams)]
        for t in ths:
            t.start()
        time.sleep(args.warmup)
        t_long = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions", json.dumps({"prompt": [5] * args.long, "max_tokens": 1}),
                  {"Content-Type": "application/json"})
        c.getresponse().read()
        t_done = time.perf_counter()
        time.sleep(0.5)
        stop.set()
        for t in ths:
            t.join()
        before, during = [], []
        for ts in times:
            for a, b in zip(ts, ts[1:]):
                (during if b > t_long and a < t_done else before if b <= t_long else []).append(1e3 * (b - a))
        return {"setting": step_tokens, "prefill_ms": 1e3 * (t_done - t_long), "before": before, "during": during}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k3", default="build/k3")
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--long", type=int, default=3000, help="tokens of the long prompt")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=4000, help="of each stream (they must outlast the prefill)")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds of decoding before the long prompt")
    ap.add_argument("--settings", default="0,64", help="--max-step-tokens values to compare")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    print(f"{args.streams} streams decoding, then one {args.long}-token prompt; gaps between a stream's chunks (ms)")
    print(f"{'max-step-tokens':>16} {'before p50':>11} {'p99':>8} {'during p50':>11} {'p99':>8} {'max':>8} "
          f"{'long TTFT ms':>13}")
    for s in [int(x) for x in args.settings.split(",")]:
        r = run(args, s)
        b, d = r["before"], r["during"]
        print(f"{s:>16} {statistics.median(b):11.1f} {pct(b, 0.99):8.1f} {statistics.median(d) if d else float('nan'):11.1f} "
              f"{pct(d, 0.99):8.1f} {max(d) if d else float('nan'):8.1f} {r['prefill_ms']:13.0f}")


if __name__ == "__main__":
    main()
