#!/bin/bash
# call G: verify attention sweep at the launch-bound shapes (back-to-back dispatches)
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 40 python3 bench/attention_kernel.py --torch-copy --out $OUT/attn > /dev/null 2>&1
timeout 200 python3 bench/attention_kernel.py --no-xla --shapes 1:1024 --sweep --budget-s 170 \
  --sweep-configs 32:3:4:256,32:3:4:64,16:4:4:64,16:4:4:32,16:2:4:64,16:4:4:64:264,32:3:4:64:264 \
  --sweep-shapes 1:1024,1:4096,1:32768,8:1024,8:4096 --out $OUT/attn > $OUT/attn.log 2>&1; echo "attn rc $?"
grep -A60 -i "sweep" $OUT/attn/attention_bench.md | head -50
