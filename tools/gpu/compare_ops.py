#!/usr/bin/env python3
"""Runs `k3 op run --device cuda` (fp32 and bf16 storage) on every op fixture and prints the
relative L2 error of each output and gradient against the fixture's reference. Exit 1 when any
exceeds the tolerance (1e-4 fp32, 5e-3 bf16; fixtures/README.md)."""
import os
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

fixtures, outdir = sys.argv[1], sys.argv[2]
os.makedirs(outdir, exist_ok=True)
worst_fail = False
for name in sorted(os.listdir(fixtures)):
    if not name.endswith(".safetensors"):
        continue
    ref = load_file(os.path.join(fixtures, name))
    for dtype, tol in (("f32", 1e-4), ("bf16", 5e-3)):
        out = os.path.join(outdir, f"{name[:-12]}.{dtype}.safetensors")
        r = subprocess.run(["k3", "op", "run", os.path.join(fixtures, name), "-o", out, "--device", "cuda",
                            "--dtype", dtype], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{name:45s} {dtype:5s} FAILED: {r.stderr.strip()}")
            worst_fail = True
            continue
        got = load_file(out)
        errs = {}
        for k, v in got.items():
            if k in ref:
                d = v.astype(np.float64) - ref[k].astype(np.float64)
                errs[k] = float(np.linalg.norm(d) / max(np.linalg.norm(ref[k].astype(np.float64)), 1e-30))
        worst = max(errs.values()) if errs else float("nan")
        ok = errs and worst <= tol
        worst_fail |= not ok
        print(f"{name:45s} {dtype:5s} {'ok ' if ok else 'BAD'} worst {worst:.2e} over {len(errs)} tensors "
              f"({', '.join(f'{k}={e:.1e}' for k, e in sorted(errs.items()))})")
sys.exit(1 if worst_fail else 0)
