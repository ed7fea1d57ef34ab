#!/bin/bash
# call D: estimator engine-draft cases; verify attention per-kernel durations under ncu
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
( timeout 230 python3 bench/estimator_step.py --batches 1,128,512 --positions 7 --features-impls ref --observe-impls pallas --reps 5 --budget-s 190 --out $OUT/est > $OUT/est.log 2>&1; echo "est rc $?" )
tail -3 $OUT/est.log; cat $OUT/est/estimator_step.md | head -60
( timeout 150 ncu --clock-control none --kernel-name regex:attention --metrics gpu__time_duration.sum --csv python3 .carry/attn_probe.py > $OUT/ncu.csv 2> $OUT/ncu.err; echo "ncu rc $?" )
grep -c attention $OUT/ncu.csv; tail -3 $OUT/ncu.err
