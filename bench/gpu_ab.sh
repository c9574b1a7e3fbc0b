#!/usr/bin/env bash
# The agent's CUDA cost of two commits on one warm GPU machine (docs/gpu.md), after
# `make gpu-check` at the newer one. Here, with a registry:
#   make gpu-wheels
#   git archive <older rev> -o .gpu-wheels/before.tar && git archive HEAD -o .gpu-wheels/after.tar
# There (carry .gpu-wheels): bash bench/gpu_ab.sh
set -u
START=$(date +%s)
HERE=$(pwd)
mkdir -p /tmp/after /tmp/before
tar -xf .gpu-wheels/after.tar -C /tmp/after && tar -xf .gpu-wheels/before.tar -C /tmp/before
ln -sfn "$HERE/.gpu-wheels" /tmp/after/.gpu-wheels
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cd /tmp/after && make -i gpu-check GPU_SITE=/tmp/site-after 2>&1 | tail -n 120)
echo "== gpu-check done after $(( $(date +%s) - START )) s"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site-before /tmp/before 2>&1 | tail -3
echo "== before.tar: agent_overhead --cuda"
(cd /tmp/before && PYTHONPATH=/tmp/site-before:/tmp/site-after PYTHONUNBUFFERED=1 timeout 100 \
    python3 -P bench/agent_overhead.py --cuda --no-server --stages 0,3 --repeats 4 2>&1 | tail -n 30)
echo "== after.tar again: agent_overhead --cuda"
(cd /tmp/after && PYTHONPATH=/tmp/site-after PYTHONUNBUFFERED=1 timeout 100 python3 -P \
    bench/agent_overhead.py --cuda --no-server --stages 0,3 --repeats 4 2>&1 | tail -n 30)
echo "== total $(( $(date +%s) - START )) s"
