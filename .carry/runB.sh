#!/bin/bash
# call B: estimator engine-draft cases, attention per-kernel durations (ncu), the engine GPU test
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
( timeout 200 python3 bench/estimator_step.py --batches 1,128,512 --positions 7 --features-impls ref --observe-impls pallas --reps 5 --out $OUT/est > $OUT/est.log 2>&1; echo "est rc $?" )
tail -3 $OUT/est.log
( timeout 120 ncu --clock-control none --kernel-name regex:attention --metrics gpu__time_duration.sum --csv python3 .carry/attn_probe.py > $OUT/ncu.csv 2> $OUT/ncu.err; echo "ncu rc $?" )
grep -c attention $OUT/ncu.csv; tail -3 $OUT/ncu.err
timeout 230 python3 -m pytest -q -m gpu tests/test_gpu_model.py -x > $OUT/gpu_model.log 2>&1; echo "gpu_model rc $?"; tail -3 $OUT/gpu_model.log
