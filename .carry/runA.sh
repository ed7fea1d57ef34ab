#!/bin/bash
# call A: the one-kernel lane top-k: GPU tests (subset), then the bench at 1024 rows (XLA baselines skipped)
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import flax, optax, jax; print(jax.__version__, jax.devices())" 2>&1 | tail -1
timeout 300 python3 -m pytest -q -m gpu tests/test_pallas_topk_lanes.py -k "not (7-248320 or 33-1000)" > $OUT/tl_gpu.log 2>&1; echo "tl_gpu rc $?"; tail -4 $OUT/tl_gpu.log
timeout 60 python3 bench/topk_kernel.py --torch-copy --out $OUT/topk > /dev/null 2>&1
timeout 220 python3 bench/topk_kernel.py --rows 1024 --no-xla --reps 9 --budget-s 180 --out $OUT/topk > $OUT/topk.log 2>&1; echo "topk rc $?"
grep -A40 "Lane-buffer" $OUT/topk/topk_bench.md | head -30
