#!/bin/bash
# call E: verify attention at the launch-bound shapes with back-to-back dispatches
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 60 python3 bench/attention_kernel.py --torch-copy --out $OUT/attn > /dev/null 2>&1
timeout 300 python3 bench/attention_kernel.py --no-xla --shapes 1:1024,1:4096,1:32768,8:1024,8:4096,64:4096 --out $OUT/attn > $OUT/attn.log 2>&1; echo "attn rc $?"
cat $OUT/attn/attention_bench.md
