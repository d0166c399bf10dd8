#!/usr/bin/env bash
# On the GPU machine (see pack.sh; K3_GPU_EXTRA packs a second build's binaries): times one
# `k3` command line with two or more k3 binaries, alternating them for `rounds` rounds so that
# clock and thermal drift fall on all of them, and prints each run's lines that match a pattern.
# Usage: bash tools/gpu/ab.sh [-r rounds] [-g grep-regex] "bench kernels --only mla ..." k3 k3-branch [...]
set -uo pipefail
rounds=2 pattern='.'
while getopts "r:g:" o; do
  case $o in
    r) rounds=$OPTARG ;;
    g) pattern=$OPTARG ;;
    *) echo "usage: ab.sh [-r rounds] [-g regex] \"k3 arguments\" binary binary [...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -lt 3 ]; then
  echo "usage: ab.sh [-r rounds] [-g regex] \"k3 arguments\" binary binary [...]" >&2
  exit 2
fi
args=$1
shift
for b in "$@"; do
  command -v "$b" >/dev/null || { echo "ab.sh: no binary '$b' on PATH (pack.sh's K3_GPU_EXTRA?)" >&2; exit 2; }
done
for ((r = 1; r <= rounds; ++r)); do
  for b in "$@"; do
    echo "== round $r: $b $args"
    # shellcheck disable=SC2086  # the k3 arguments are word-split on purpose
    stdbuf -oL "$b" $args 2>&1 | grep -E -- "$pattern"
  done
done
