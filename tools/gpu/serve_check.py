# GPU check of k3 serve (tools/gpu/run.sh runs it as an extra command): starts `k3 serve` on a
# fixture model, sends two rounds of four concurrent greedy requests with the fixture's prompt
# (16 and 14 new tokens, so the batch changes as they finish), and checks every completion
# against the fixture's greedy ids (transformers) and that decode steps were replayed as CUDA
# graphs (k3_decode_steps_replayed_total > 0), or, with a third argument `queued`, that none were.
# Usage: serve_check.py MODEL_DIR [cuda|cpu] [queued]
import json, re, subprocess, sys, threading, time, urllib.request, struct
model = sys.argv[1]; device = sys.argv[2] if len(sys.argv) > 2 else 'cuda'
def load_ids(path, name):
    with open(path, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]; h = json.loads(f.read(n)); base = 8 + n
        m = h[name]; a, b = m['data_offsets']; f.seek(base + a); raw = f.read(b - a)
        return list(struct.unpack('<%dq' % ((b - a) // 8), raw))
prompt = load_ids(model + '/expected.safetensors', 'prompt_ids')
want = load_ids(model + '/expected.safetensors', 'greedy_ids')[len(prompt):]
srv = subprocess.Popen(['k3', 'serve', '--model', model, '--device', device, '--port', '8123', '--max-batch', '4'],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for _ in range(100):
    try:
        urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=1); break
    except Exception:
        time.sleep(0.2)
results = [None] * 4
def ask(i, n):
    body = json.dumps({'prompt': prompt, 'max_tokens': n, 'temperature': 0, 'ignore_eos': True}).encode()
    r = urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:8123/v1/completions', body,
                               {'Content-Type': 'application/json'}), timeout=120)
    results[i] = json.loads(r.read())
ok = True
for rnd in range(2):
    ts = [threading.Thread(target=ask, args=(i, len(want) - 2 * (i % 2))) for i in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    for i, res in enumerate(results):
        got = res['choices'][0]['token_ids']
        n = len(want) - 2 * (i % 2)
        good = got == want[:n]
        ok &= good
        print(f'round {rnd} request {i}: {"ok" if good else "MISMATCH"} {got[:6]}... ({len(got)} tokens)')
m = urllib.request.urlopen('http://127.0.0.1:8123/metrics').read().decode()
for line in m.splitlines():
    if line.startswith('k3_decode_steps') or line.startswith('k3_decode_batch'): print(line)
replayed = int(float(re.search(r'^k3_decode_steps_replayed_total (\S+)', m, re.M).group(1)))
ok &= (replayed > 0) == (len(sys.argv) <= 3 or sys.argv[3] != 'queued')
srv.terminate(); out = srv.communicate(timeout=10)[0]
print(out[-1500:])
print('SERVE_CHECK', 'OK' if ok else 'FAILED')
