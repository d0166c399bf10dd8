#!/usr/bin/env python3
"""Integration test of `k3 serve` with real HTTP clients (the `openai` package and curl) on
loopback: streaming and non-streaming completions and chat, outputs equal to `k3 generate` for the
same seed, concurrent requests, prefix-cache hits, client disconnects, a few hundred malformed
requests (the server stays healthy), /metrics.

A second server (Kimi K3 tiny: MLA latent cache + KDA states, a 4096-token context) serves the
checks that need long generations: a client that disconnects, streaming or not, is cancelled early.

Usage: serve_integration.py K3_BINARY FIXTURE_MODEL_DIR KJV_TEXT (the Kimi K3 fixture is found
beside FIXTURE_MODEL_DIR)
Exits 77 (CTest: skipped) only when python3's `openai` package is missing.
"""
import array
import http.client
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

try:
    import openai
except ImportError:
    print("SKIP: the python 'openai' package is not installed (pip install openai); scripts/test.sh installs it")
    sys.exit(77)

K3, FIXTURE, KJV = sys.argv[1], sys.argv[2], sys.argv[3]
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def generate_ids(model, prompt_ids, n, seed, temperature, top_k=0):
    out = subprocess.run([K3, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt_ids)),
                          "--max-new-tokens", str(n), "--seed", str(seed), "--temperature", str(temperature),
                          "--top-k", str(top_k), "--print-ids", "--ignore-eos", "--threads", "1"],
                         capture_output=True, text=True, check=True).stdout
    ids = [int(x) for x in out.strip().splitlines()[-1].split()]
    return ids[len(prompt_ids):]


def generate_text(model, prompt, n, seed, temperature):
    """(new ids, new text bytes) of k3 generate with a text prompt."""
    out = subprocess.run([K3, "generate", "--model", model, "--prompt", prompt, "--max-new-tokens", str(n),
                          "--seed", str(seed), "--temperature", str(temperature), "--ignore-eos", "--threads", "1",
                          "--print-ids"], capture_output=True, check=True).stdout
    body, ids_line = out[:-1].rsplit(b"\n", 1)
    ids = [int(x) for x in ids_line.split()]
    p = prompt.encode()
    assert body.startswith(p)
    return ids, body[len(p):]  # generate ends its text with a newline


def log_softmax_rows(model, ids, tmp):
    """log-softmax of `k3 logits` over ids (the whole sequence), row t predicting ids[t + 1]."""
    header = json.dumps({"input_ids": {"dtype": "I64", "shape": [1, len(ids)], "data_offsets": [0, 8 * len(ids)]}})
    header += " " * (-len(header) % 8)
    src, dst = os.path.join(tmp, "ids.safetensors"), os.path.join(tmp, "logits.safetensors")
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode() + struct.pack(f"<{len(ids)}q", *ids))
    subprocess.run([K3, "logits", "--model", model, "--input", src, "--output", dst, "--threads", "1"], check=True,
                   capture_output=True)
    with open(dst, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))["logits"]
        data = f.read()[meta["data_offsets"][0]:meta["data_offsets"][1]]
    V = meta["shape"][2]
    flat = array.array("f", data)
    rows = []
    for t in range(len(ids)):
        row = flat[t * V:(t + 1) * V]
        mx = max(row)
        lse = mx + math.log(sum(math.exp(x - mx) for x in row))
        rows.append([x - lse for x in row])
    return rows


def same_text(got, want_bytes):
    """The server's JSON text equals generate's bytes (invalid UTF-8 from a random model becomes U+FFFD)."""
    try:
        return got == want_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return got.encode("utf-8", "replace").replace("\ufffd".encode(), b"") != b"" or got != ""


def metrics(base):
    """/metrics as {sample name with labels: value}."""
    text = subprocess.run(["curl", "-s", base + "/metrics"], capture_output=True, text=True).stdout
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def start_server(model, *args):
    """(process, base URL) of `k3 serve` on a free loopback port."""
    srv = subprocess.Popen([K3, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0", "--threads", "1",
                            *args], stdout=subprocess.PIPE, text=True)
    line = srv.stdout.readline()
    check("listening on http://127.0.0.1:" in line, "server started: " + line.strip())
    return srv, "http://127.0.0.1:" + line.strip().rsplit(":", 1)[1]


def stop_server(srv):
    srv.send_signal(signal.SIGTERM)
    try:
        rc = srv.wait(timeout=30)
        check(rc == 0, f"server exits cleanly on SIGTERM (rc {rc})")
    except subprocess.TimeoutExpired:
        srv.kill()
        check(False, "server exits on SIGTERM")


def api_fault_checks(base, port):
    """Wrong methods get 405 with Allow; HTTP-level errors carry a code; numbers are echoed as sent;
    a streamed reply that times out says so in its last chunk, as the non-streamed one does."""
    for method, path, allow in [("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
                                ("POST", "/health", "GET"), ("PUT", "/v1/models", "GET")]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request(method, path, b"{}" if method != "GET" else None)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        check(resp.status == 405 and resp.getheader("Allow") == allow and body["error"]["code"] == "method_not_allowed",
              f"{method} {path} -> 405, Allow: {allow} (got {resp.status}, {resp.getheader('Allow')})")
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"NOT A REQUEST LINE\r\n\r\n")
    sock.settimeout(30)
    raw = b""
    try:
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            piece = sock.recv(4096)
            if not piece:
                break
            raw += piece
    except socket.timeout:
        pass
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        code = json.loads(body)["error"]["code"]
    except Exception:
        code = None
    check(head.startswith(b"HTTP/1.1 400") and code == "bad_request", f"a malformed request line -> 400 bad_request ({code})")
    big = str(2 ** 63)
    out = subprocess.run(["curl", "-s", base + "/v1/completions", "-d", '{"prompt":[' + big + "],\"max_tokens\":1}"],
                         capture_output=True, text=True).stdout
    check(big in json.loads(out)["error"]["message"], "a token id of 2^63 is echoed as sent")
    out = subprocess.run(["curl", "-s", "-N", base + "/v1/completions", "-d",
                          json.dumps({"prompt": [1, 2], "max_tokens": 120, "stream": True, "ignore_eos": True,
                                      "timeout": 0.001})], capture_output=True, text=True).stdout
    chunks = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    check(bool(last) and last[-1]["choices"][0].get("k3_finish") == "timeout",
          "a streamed reply that times out ends with k3_finish: timeout")


def memory_pressure_checks(model):
    """A budget of about 19 pages for 8 concurrent requests needing 7 each: sequences are preempted
    and recomputed, and every output still equals k3 generate with its seed."""
    srv, base = start_server(model, "--max-batch", "8", "--memory-mb", "0.3", "--cache-block", "0")
    try:
        reqs = [([1 + i, 2, 3 + i], 96 + i, i, 0.8) for i in range(8)]
        results = [None] * len(reqs)

        def worker(i):
            p, n, seed, t = reqs[i]
            body = json.dumps({"prompt": p, "max_tokens": n, "seed": seed, "temperature": t, "ignore_eos": True})
            out = subprocess.run(["curl", "-s", base + "/v1/completions", "-d", body], capture_output=True,
                                 text=True).stdout
            results[i] = json.loads(out)["choices"][0]["token_ids"]
        ths = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
        [t.start() for t in ths]
        [t.join() for t in ths]
        m = metrics(base)
        same = sum(results[i] == generate_ids(model, *reqs[i]) for i in range(len(reqs)))
        check(m["k3_preemptions_total"] > 0 and same == len(reqs),
              f"under memory pressure: {m['k3_preemptions_total']:.0f} preemptions, {same}/8 outputs == k3 generate")
        check(m["k3_memory_reserved_bytes"] == 0 and m['k3_memory_pages{kind="kv-cache",state="used"}'] == 0,
              "every page is returned")
    finally:
        stop_server(srv)


def await_cancel(base, m0, kind):
    """Checks that one request (of max_tokens 4000) is cancelled within 20 s, far short of its end."""
    cancelled = 'k3_requests_finished_total{reason="cancelled"}'
    t0, m1 = time.time(), m0
    while time.time() - t0 < 20 and m1[cancelled] == m0[cancelled]:
        time.sleep(0.05)
        m1 = metrics(base)
    made = m1["k3_generation_tokens_total"] - m0["k3_generation_tokens_total"]
    check(m1[cancelled] == m0[cancelled] + 1 and made < 2000,
          f"{kind} client disconnect cancels the request ({made:.0f} of 4000 tokens made)")


def long_context_checks(model):
    srv, base = start_server(model, "--ctx", "4096", "--max-batch", "4")
    try:
        port = int(base.rsplit(":", 1)[1])
        # A non-streaming client that sends a long request and hangs up: the request is cancelled
        # within moments, far short of max_tokens (a few seconds of work; under a loaded test run
        # about a thousand tokens come out before the poll notices), and the server carries on.
        m0 = metrics(base)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.3)
        sock.close()
        await_cancel(base, m0, "non-streaming")
        # The same for a streaming client that hangs up after the first bytes.
        m0 = metrics(base)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [4, 4], "max_tokens": 4000, "stream": True,
                                                            "ignore_eos": True}), {"Content-Type": "application/json"})
        conn.getresponse().read1(64)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        await_cancel(base, m0, "streaming")
        h = subprocess.run(["curl", "-s", base + "/health"], capture_output=True, text=True).stdout
        check(json.loads(h)["status"] == "ok", "healthy after the disconnect")
        # Memory pages: the Kimi K3 model grows a latent cache (pages) and keeps KDA states (fixed);
        # idle, every page is free and nothing is held.
        m = metrics(base)
        check(m.get('k3_memory_pages{kind="latent-cache",state="used"}') == 0
              and m.get('k3_memory_pages{kind="latent-cache",state="free"}', 0) > 0
              and 'k3_memory_pages{kind="recurrent-state",state="free"}' not in m
              and m["k3_memory_reserved_bytes"] == 0, "idle server: latent-cache pages all free, none held")
    finally:
        stop_server(srv)


def tool_call_checks(tmp, corpus):
    """A tool-call conversation through the openai client: a model (Kimi K3 tiny, for its long
    context) whose tokenizer has the Hermes
    call tokens and whose chat template renders tools, tool calls and tool results. tool_choice
    naming the function makes the (random) model's output that function's arguments, constrained
    to its parameters; the reply carries them as tool_calls, streamed or not; the tool's result
    goes back and the final answer is text. response_format json_schema output validates."""
    model = os.path.join(tmp, "k3-tiny-tools")
    shutil.copytree(os.path.join(os.path.dirname(os.path.normpath(FIXTURE)), "kimi-k3-tiny"), model)
    tj = os.path.join(model, "tokenizer.json")
    subprocess.run([K3, "tokenizer", "train", corpus, "--vocab-size", "507", "-o", tj], check=True, capture_output=True)
    with open(tj) as f:
        t = json.load(f)
    for i, tok in enumerate(["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>"]):
        t["added_tokens"].append({"id": 507 + i, "content": tok, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    with open(tj, "w") as f:
        json.dump(t, f)
    template = ("{% if tools %}<|system|>Tools: {{ tools | tojson }}\n{% endif %}"
                "{% for m in messages %}<|{{ m.role }}|>{{ m.content if m.content else '' }}"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
                "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|assistant|>")
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": "<|im_end|>"}, f)
    srv, base = start_server(model, "--max-batch", "4", "--ctx", "1024")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        tools = [{"type": "function", "function": {
            "name": "add", "description": "Adds two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}}]
        messages = [{"role": "user", "content": "What is 2 plus 3?"}]
        r = client.chat.completions.create(model="k3-tiny-tools", messages=messages, tools=tools, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0.8, seed=1)
        c = r.choices[0]
        calls = c.message.tool_calls or []
        check(c.finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "add",
              f"tool_choice add: one tool call ({c.finish_reason}, {calls})")
        args = json.loads(calls[0].function.arguments) if calls else {}
        check(isinstance(args.get("a"), int) and isinstance(args.get("b"), int) and set(args) <= {"a", "b"},
              f"its arguments validate against the parameters ({args})")
        check(c.message.content is None, "no content beside the call")
        # Streamed: the same call arrives as a tool_calls delta.
        deltas, finish = [], None
        for ch in client.chat.completions.create(model="k3-tiny-tools", messages=messages, tools=tools,
                                                 max_tokens=80, stream=True, temperature=0.8, seed=1,
                                                 tool_choice={"type": "function", "function": {"name": "add"}}):
            if ch.choices and ch.choices[0].delta.tool_calls:
                deltas += ch.choices[0].delta.tool_calls
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        check(finish == "tool_calls" and len(deltas) == 1 and deltas[0].function.name == "add" and
              json.loads(deltas[0].function.arguments) == args and deltas[0].index == 0,
              "streamed: the same call as a tool_calls delta")
        # The tool's result goes back; with tool_choice none the answer is text.
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "add", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
        r = client.chat.completions.create(model="k3-tiny-tools", messages=messages, tools=tools, max_tokens=8,
                                           tool_choice="none", temperature=0.8, seed=2)
        check(r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str) and
              r.usage.prompt_tokens > 40, "tool result sent back: a text answer")
        # auto: whatever the untrained model writes comes back without an error.
        r = client.chat.completions.create(model="k3-tiny-tools", messages=messages, tools=tools, max_tokens=20,
                                           temperature=1.0, seed=3)
        check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), "tool_choice auto answers")
        # Structured output: every sampled reply parses and has the schema's shape.
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "n": {"type": "integer"}}, "required": ["name", "n"]}
        ok = 0
        for seed in range(10):
            r = client.chat.completions.create(model="k3-tiny-tools", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=120, temperature=1.0, seed=seed, response_format={
                                                   "type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
            v = json.loads(r.choices[0].message.content)
            ok += (r.choices[0].finish_reason == "stop" and isinstance(v["name"], str) and len(v["name"]) <= 8
                   and isinstance(v["n"], int) and set(v) == {"name", "n"})
        check(ok == 10, f"response_format json_schema: {ok} of 10 replies parse and validate")
    finally:
        stop_server(srv)


def main():
    tmp = tempfile.mkdtemp(prefix="k3-serve-test-")
    model = os.path.join(tmp, "gpt2-tiny")
    shutil.copytree(FIXTURE, model)
    with open(KJV, encoding="utf-8", errors="replace") as f:
        text = f.read(60000)
    with open(os.path.join(tmp, "corpus.txt"), "w") as f:
        f.write(text)
    subprocess.run([K3, "tokenizer", "train", os.path.join(tmp, "corpus.txt"), "--vocab-size", "512", "-o",
                    os.path.join(model, "tokenizer.json")], check=True, capture_output=True)

    srv, base = start_server(model, "--max-batch", "4", "--cache-block", "16")
    try:
        port = int(base.rsplit(":", 1)[1])
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        name = "gpt2-tiny"

        # /health, /v1/models with curl.
        h = subprocess.run(["curl", "-s", base + "/health"], capture_output=True, text=True).stdout
        check(json.loads(h)["status"] == "ok", "curl /health")
        check(client.models.list().data[0].id == name, "openai models.list")

        # Non-streaming, token-id prompt, sampled: equals k3 generate.
        prompt = [5, 17, 42, 7, 99]
        want = generate_ids(model, prompt, 12, 5, 0.8)
        r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0.8, seed=5,
                                      extra_body={"ignore_eos": True})
        check(r.choices[0].model_extra["token_ids"] == want, f"non-streaming ids == k3 generate ({want})")
        check(r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5, "usage counts")

        # The non-streaming answer is one plain JSON body (the disconnect watch changes nothing on the wire).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 3}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        check(resp.status == 200 and resp.getheader("Content-Type") == "application/json"
              and resp.getheader("Content-Length") == str(len(raw)) and json.loads(raw)["object"] == "text_completion",
              "non-streaming response: 200, application/json, Content-Length")

        # Streaming, same request.
        got = []
        chunks = 0
        for ch in client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0.8, seed=5,
                                            stream=True, extra_body={"ignore_eos": True}):
            chunks += 1
            got += ch.choices[0].model_extra.get("token_ids", [])
        check(got == want and chunks >= 2, f"streaming ids == k3 generate ({chunks} chunks)")

        # Text prompt: text equals k3 generate's.
        tp = "In the beginning God"
        all_ids, want_text = generate_text(model, tp, 10, 3, 0.7)
        r = client.completions.create(model=name, prompt=tp, max_tokens=10, temperature=0.7, seed=3,
                                      extra_body={"ignore_eos": True})
        n_prompt = r.usage.prompt_tokens
        check(r.choices[0].model_extra["token_ids"] == all_ids[n_prompt:], "text prompt: ids == k3 generate")
        check(same_text(r.choices[0].text, want_text), f"text completion == k3 generate ({want_text!r})")
        s = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt=tp, max_tokens=10, temperature=0.7, seed=3, stream=True,
            extra_body={"ignore_eos": True}))
        check(s == r.choices[0].text, "streamed text == non-streamed text")

        # n choices: choice i samples with seed + i, each equal to k3 generate with that seed.
        r = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0.9, seed=20, n=3,
                                      extra_body={"ignore_eos": True})
        got = {c.index: c.model_extra["token_ids"] for c in r.choices}
        check(got == {i: generate_ids(model, prompt, 6, 20 + i, 0.9) for i in range(3)},
              "n=3: choice i == k3 generate --seed 20+i")
        check(r.usage.completion_tokens == 18, "n=3: usage sums the choices")
        streamed = {}
        for ch in client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0.9, seed=20, n=3,
                                            stream=True, extra_body={"ignore_eos": True}):
            for c in ch.choices:
                streamed.setdefault(c.index, []).extend(c.model_extra.get("token_ids", []))
        check(streamed == got, "n=3 streamed == non-streamed")

        # echo + logprobs: the prompt leads the text, and every token's logprob (prompt tokens after
        # the first, then the new ones) is the log-softmax of `k3 logits` over the whole sequence.
        r = client.completions.create(model=name, prompt=tp, max_tokens=5, temperature=0.8, seed=2, echo=True,
                                      logprobs=3, extra_body={"ignore_eos": True})
        c = r.choices[0]
        check(c.text.startswith(tp), f"echo: the text starts with the prompt ({c.text[:40]!r})")
        lp = c.logprobs
        n_prompt = r.usage.prompt_tokens
        new_ids = c.model_extra["token_ids"]
        prompt_ids = [int(x) for x in subprocess.run(
            [K3, "generate", "--model", model, "--prompt", tp, "--max-new-tokens", "0", "--print-ids"],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1].split()]
        seq = prompt_ids + new_ids
        rows = log_softmax_rows(model, seq, tmp)
        ok = len(lp.token_logprobs) == len(seq) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        worst = 0.0
        for t in range(1, len(seq) if ok else 0):
            ref = rows[t - 1]
            best = sorted(ref, reverse=True)[:3]
            worst = max(worst, abs(lp.token_logprobs[t] - ref[seq[t]]),
                        *(abs(a - b) for a, b in zip(sorted(lp.top_logprobs[t].values(), reverse=True), best)))
            ok = ok and len(lp.top_logprobs[t]) <= 3
        check(ok and worst < 2e-3 and len(prompt_ids) == n_prompt,
              f"echo + logprobs == log-softmax of k3 logits ({len(seq)} tokens, max error {worst:.1e})")
        check(all(c.text.startswith(lp.tokens[t], lp.text_offset[t]) for t in range(n_prompt)),
              "logprobs text_offset: each echoed prompt token's text starts at its offset")

        # Chat, both ways.
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made the light?"}]
        c = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0, seed=1)
        check(c.choices[0].message.role == "assistant" and isinstance(c.choices[0].message.content, str),
              f"chat completion ({c.choices[0].message.content!r})")
        sc = "".join((ch.choices[0].delta.content or "") for ch in client.chat.completions.create(
            model=name, messages=msgs, max_tokens=8, temperature=0, seed=1, stream=True) if ch.choices)
        check(sc == c.choices[0].message.content, "streamed chat == non-streamed chat")
        c = client.chat.completions.create(model=name, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=2, extra_body={"ignore_eos": True})
        content = c.choices[0].logprobs.content
        check(len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
              and all(e.logprob == e.top_logprobs[0].logprob for e in content),  # greedy: the chosen is the best
              "chat logprobs: 4 tokens, 2 alternatives each, greedy picks the most likely")

        # curl, streaming.
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 5, "stream": True, "seed": 2})
        out = subprocess.run(["curl", "-sN", base + "/v1/completions", "-H", "Content-Type: application/json",
                              "-d", body], capture_output=True, text=True).stdout
        check(out.count("data: ") >= 3 and out.rstrip().endswith("data: [DONE]"), "curl SSE stream ends with [DONE]")

        # Concurrent requests (batched decode) each equal k3 generate.
        reqs = [([3 + i, 8, 13 + i, 21], 6 + i % 3, 100 + i, 0.9 if i % 2 else 0.0) for i in range(8)]
        results = [None] * len(reqs)

        def worker(i):
            p, n, seed, t = reqs[i]
            rr = client.completions.create(model=name, prompt=p, max_tokens=n, temperature=t, seed=seed,
                                           extra_body={"ignore_eos": True})
            results[i] = rr.choices[0].model_extra["token_ids"]
        ths = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
        [t.start() for t in ths]
        [t.join() for t in ths]
        ok = all(results[i] == generate_ids(model, *reqs[i]) for i in range(len(reqs)))
        check(ok, "8 concurrent requests each == k3 generate")

        # Shared prefix: the second request resumes from a snapshot.
        shared = [random.Random(9).randrange(1, 300) for _ in range(40)]
        client.completions.create(model=name, prompt=shared + [1], max_tokens=2, temperature=0)
        r2 = client.completions.create(model=name, prompt=shared + [2, 3], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
        cached = r2.usage.model_dump().get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check(cached == 32, f"shared prefix served from the cache ({cached} tokens)")
        check(r2.choices[0].model_extra["token_ids"] == generate_ids(model, shared + [2, 3], 4, 0, 0),
              "cache-hit output == k3 generate (greedy)")

        # Malformed requests over HTTP: all 4xx with an OpenAI error body.
        rng = random.Random(7)
        seeds = ['{"prompt":[1,2,3],"max_tokens":4,"temperature":0.5,"seed":1}',
                 '{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}',
                 '{"prompt":"hello","stop":["x"],"top_p":0.9}']
        bad_status, bad_body, n_ok = 0, 0, 0
        for i in range(300):
            s = rng.choice(seeds)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(s)) if s else 0
                op = rng.randrange(4)
                if op == 0:
                    s = s[:at] + s[at + 1:]
                elif op == 1:
                    s = s[:at] + rng.choice('{}[]",:-1e.x\\') + s[at:]
                elif op == 2:
                    s = s[:at]
                else:
                    s = s[:at] + '"max_tokens":-5,' + s[at:]
            path = "/v1/chat/completions" if "messages" in s else "/v1/completions"
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", path, s.encode("utf-8", "replace"), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            if resp.status == 200:
                n_ok += 1
                continue
            if not (400 <= resp.status < 500):
                bad_status += 1
                continue
            try:
                e = json.loads(data)["error"]
                assert {"message", "type", "param", "code"} <= set(e)
            except Exception:
                bad_body += 1
        check(bad_status == 0 and bad_body == 0, f"300 mutated requests: 4xx with error bodies ({n_ok} were valid)")
        for body, code in [("{", 400), ('{"prompt":[1],"temperature":-1}', 400), ('{"prompt":[1],"max_tokens":"x"}', 400),
                           ('{"prompt":[' + ",".join(["1"] * 200) + "]}", 400), ('{"prompt":[1],"model":"nope"}', 404)]:
            out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", base + "/v1/completions",
                                  "-d", body], capture_output=True, text=True).stdout
            check(out == str(code), f"curl bad request -> {code} ({body[:40]})")
        check(json.loads(subprocess.run(["curl", "-s", base + "/health"], capture_output=True, text=True).stdout)["status"] == "ok",
              "healthy after the bad requests")
        api_fault_checks(base, port)
        r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0.8, seed=5,
                                      extra_body={"ignore_eos": True})
        check(r.choices[0].model_extra["token_ids"] == want, "still correct after the bad requests")

        m = subprocess.run(["curl", "-s", base + "/metrics"], capture_output=True, text=True).stdout
        for key in ["k3_generation_tokens_per_second", "k3_queue_depth", "k3_prefix_cache_hit_rate",
                    'k3_context_memory_bytes{kind="kv-cache"}', 'k3_prefix_cache_bytes{kind="kv-cache"}',
                    'k3_memory_pages{kind="kv-cache",state="free"}', "k3_preemptions_total"]:
            check(key in m, "metrics has " + key)
    finally:
        stop_server(srv)
    try:
        tool_call_checks(tmp, os.path.join(tmp, "corpus.txt"))
        memory_pressure_checks(model)
        k3_model = os.path.join(tmp, "kimi-k3-tiny")
        shutil.copytree(os.path.join(os.path.dirname(os.path.normpath(FIXTURE)), "kimi-k3-tiny"), k3_model)
        long_context_checks(k3_model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
