#!/usr/bin/env bash
# The regime map on every architecture and its explanation, one architecture at a time (one worker each):
#   experiments/regime_map/rerun.sh [CELLS=core] [STEPS=6] [ARCHS="hybrid gqa mla"]
# -> results/map_<CELLS>_<arch>.csv/.png (run.py) and results/explain_map_<CELLS>_<arch>*.csv/.png (explain.py).
# A stopped rerun continues with RESUME=1: the cells already in results/map_<CELLS>_<arch>.csv are kept (run.py --resume);
# without it every cell runs again (a rerun after a code change must not keep the old cells).
set -euo pipefail
cd "$(dirname "$0")/../.."
cells=${1:-core}; steps=${2:-6}; archs=${3:-hybrid gqa mla}
py=${PYTHON:-.venv/bin/python}
for arch in $archs; do
  echo "== $arch: map ($cells, $steps steps) at $(git rev-parse --short HEAD), $(date -u +%H:%M:%S)"
  $py experiments/regime_map/run.py --cells "$cells" --steps "$steps" --arch "$arch" --jobs 1 --name "map_${cells}_${arch}" ${RESUME:+--resume}
  echo "== $arch: explain, $(date -u +%H:%M:%S)"
  $py experiments/regime_map/explain.py --map "map_${cells}_${arch}"
done
echo "== done $(date -u +%H:%M:%S)"
