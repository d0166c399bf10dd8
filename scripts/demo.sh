#!/usr/bin/env bash
# Quick start, command 1: install, build, and run k3's main job on its built-in default.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
SHARED="${K3_SHARED_DIR:-$(cd .. && pwd)/shared}"

echo "== k3 info --preset k3-tiny"
./build/k3 info --preset k3-tiny
echo
echo "== k3 train   (k3-tiny on the King James Bible, CPU)"
./build/k3 train
