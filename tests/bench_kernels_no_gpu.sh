#!/bin/sh
# `k3 bench kernels` where no GPU is usable: it fails with a message that says what it needs (a
# GPU, or a CUDA build) and names no --device option (the command has none). Exit 77 (skipped)
# where a GPU is present: there the command runs the benchmarks.
k3="$1"
if nvidia-smi -L >/dev/null 2>&1; then exit 77; fi
if out=$("$k3" bench kernels 2>&1); then
  echo "bench kernels succeeded without a GPU: $out"
  exit 1
fi
case "$out" in
  *"needs an NVIDIA GPU"* | *"built without the CUDA backend"*) ;;
  *) echo "unexpected message: $out"; exit 1 ;;
esac
case "$out" in
  *--device*) echo "the message names a --device option: $out"; exit 1 ;;
esac
echo "ok: $out"
