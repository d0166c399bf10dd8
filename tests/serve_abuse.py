#!/usr/bin/env python3
"""`k3 serve` against hostile and broken clients on loopback, with raw sockets:

- 100 clients that send a head and one byte of body, and 90 that trickle a byte every half second:
  /health answers in under a second throughout, a completion still completes, and the slow ones get
  408 when their phase's deadline passes;
- a Content-Length over the limit, or negative, is refused at once (the body never sent); a
  malformed request line is answered and its socket closed at once;
- 40 concurrent bodies of 7.8 MB (prompts far over the context) and 10 MB headers: each refused,
  and the server's resident memory back within 1.5x its baseline after each of three bursts.

Usage: serve_abuse.py K3_BINARY FIXTURE_MODEL_DIR
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

K3, MODEL = sys.argv[1], sys.argv[2]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_server():
    proc = subprocess.Popen([K3, "serve", "--model", MODEL, "--port", "0", "--threads", "1", "--header-timeout", "3",
                             "--body-timeout", "3", "--max-batch", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        print(proc.stderr.read())
        sys.exit("the server did not start: " + line)
    return proc, int(line.rsplit(":", 1)[1])


def timed_get(port, path="/health"):
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    r.read()
    c.close()
    return r.status, time.monotonic() - t0


def raw(port, data, timeout=5.0):
    """Sends data on a fresh connection; returns (first response bytes, seconds until the server
    answered and closed)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    t0 = time.monotonic()
    try:
        s.sendall(data)
    except OSError:
        pass
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    s.close()
    return got, time.monotonic() - t0


def status(resp):
    return int(resp[9:12]) if resp.startswith(b"HTTP/1.1 ") else None


def completion(port, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    c.close()
    return r.status, body


def slow_clients(port):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    stalled = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + b"{")
        stalled.append(s)
    trickling = [socket.create_connection(("127.0.0.1", port)) for _ in range(90)]
    stop = threading.Event()

    def trickle():
        msg = head + b'{"prompt": "x"'
        i = 0
        while not stop.is_set() and i < len(msg):
            for s in trickling:
                try:
                    s.send(msg[i:i + 1])
                except OSError:
                    pass
            i += 1
            stop.wait(0.5)

    t = threading.Thread(target=trickle)
    t.start()
    worst, codes = 0.0, set()
    for _ in range(10):
        code, dt = timed_get(port)
        worst = max(worst, dt)
        codes.add(code)
        time.sleep(0.2)
    check(codes == {200} and worst < 1.0,
          f"/health answers in under a second while 190 clients hold connections (worst {worst:.3f} s, {codes})")
    code, dt = timed_get(port, "/metrics")
    check(code == 200 and dt < 1.0, f"/metrics too ({dt:.3f} s)")
    t0 = time.monotonic()
    code, body = completion(port)
    check(code == 200 and len(body["choices"][0]["token_ids"]) == 4,
          f"a completion completes meanwhile ({time.monotonic() - t0:.2f} s)")
    # Deadlines: 3 s for a head, 3 s for a body.
    timed_out = 0
    for s in stalled + trickling:
        s.settimeout(6)
        try:
            got = s.recv(4096)
        except OSError:
            got = b""
        timed_out += status(got) == 408
        s.close()
    stop.set()
    t.join()
    check(timed_out == 190, f"every slow client got 408 at its deadline ({timed_out} of 190)")


def refused_at_once(port):
    for name, req, want in [
        ("a Content-Length over the 8 MiB limit", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 900000000\r\n\r\n", 413),
        ("a negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        ("a malformed request line", b"GARBAGE\r\n\r\n", 400),
        ("a head with no request line", b"\r\n" * 100, 400),
    ]:
        got, dt = raw(port, req)
        check(status(got) == want and dt < 1.0, f"{name} -> {want} and closed in {dt:.3f} s (got {got[:40]!r})")


def bursts(proc, port):
    for _ in range(3):  # warm: worker threads and their arenas exist before the baseline
        completion(port)
    time.sleep(0.5)
    base = rss_mb(proc.pid)
    print(f"baseline RSS {base:.1f} MB", flush=True)
    prompt = "In the beginning God created the heaven and the earth. " * 140000  # 7.8 MB, far over the context
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    check(7_000_000 < len(body) < 8 << 20, f"a {len(body) / 1e6:.1f} MB body, just under the 8 MiB limit")
    req = (b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)
    big_head = b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (10 << 20) + b"\r\n\r\n"
    for round_ in range(3):
        results = []
        lock = threading.Lock()
        peak = [base]

        def one(data):
            got, _ = raw(port, data, timeout=60)
            with lock:
                results.append(status(got))
                peak[0] = max(peak[0], rss_mb(proc.pid))

        threads = [threading.Thread(target=one, args=(req,)) for _ in range(40)]
        threads += [threading.Thread(target=one, args=(big_head,)) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        n400 = sum(1 for s in results if s == 400)
        check(sum(1 for s in results if s in (400, 431, None)) == 50 and n400 >= 35,
              f"round {round_ + 1}: 40 oversized prompts -> 400 context exceeded, 10 huge heads -> 431 "
              f"({sorted(set(map(str, results)))})")
        time.sleep(1.0)
        after = rss_mb(proc.pid)
        check(after <= 1.5 * base, f"round {round_ + 1}: RSS {after:.1f} MB after the burst (peak {peak[0]:.1f} MB, "
              f"baseline {base:.1f} MB, bound {1.5 * base:.1f} MB)")
    code, dt = timed_get(port)
    check(code == 200, "the server is healthy after the bursts")


def main():
    proc, port = start_server()
    try:
        refused_at_once(port)
        slow_clients(port)
        bursts(proc, port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            failures.append("the server did not stop on SIGTERM")
    check(proc.returncode == 0, f"the server stopped cleanly on SIGTERM (exit {proc.returncode})")
    if failures:
        print(f"{len(failures)} FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
