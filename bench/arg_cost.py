"""Host cost of the engine step's arguments: a jit that does almost nothing, called with one array
or with the step's own pytrees (state, target, proposer), as the decoding loop calls its step.

Every array among a jit's arguments and results costs the host a little at every call; on a
launch-bound step (the shipped tiny pair: ~0.5-1 ms a step on an H100) that is a share of the
step. Rows: `one array` (a jit of x[0]), `state` (the engine state alone), `state, target,
proposer` (the step's three pytrees), `... state donated and returned` (as the step: the state
is donated and comes back). µs a call: the median of --rounds loops of --calls back-to-back calls,
synchronised once a loop (the host's dispatch, where it is larger than the device's work).

Usage:
  PYTHONPATH=$PWD python3 bench/arg_cost.py --out $OUT [--target models/tiny-target --draft models/tiny-dflash]
Writes DIR/arg_cost.json (DIR = --out) and prints the rows.
"""

import argparse
import json
import os
import statistics
import time

import jax

from jaxspec.config import SpecConfig
from jaxspec.dflash import load_draft
from jaxspec.engine import Engine
from jaxspec.target import load_target


def per_call_us(fn, args, calls, rounds, *, threaded=False):
    """Median µs a call over `rounds` loops of `calls` back-to-back calls; threaded: fn returns
    its (donated) first argument, which the next call takes, as the step does with its state."""
    args = list(args)
    out = None
    times = []
    for round_ in range(rounds + 1):  # round 0 compiles and warms up
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
            if threaded:
                args[0] = out
        jax.block_until_ready(out)
        if round_:
            times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(engine, calls=300, rounds=5) -> dict:
    """{row: µs a call} for the rows of the module docstring, and the pytrees' array counts."""
    state, target, proposer = engine.state, engine.target, engine.proposer
    trees = {"state": state, "target": target, "proposer": proposer}
    counts = {name: len(jax.tree.leaves(x)) for name, x in trees.items()}
    touch = jax.jit(lambda s, t, p: s.anchor[0])
    rows = {
        "one array": per_call_us(jax.jit(lambda a: a[0]), (state.anchor,), calls, rounds),
        "state": per_call_us(jax.jit(lambda s: s.anchor[0]), (state,), calls, rounds),
        "state, target, proposer": per_call_us(touch, (state, target, proposer), calls, rounds),
    }
    donating = jax.jit(lambda s, t, p: s, donate_argnums=(0,))
    rows["state, target, proposer; state donated and returned"] = per_call_us(
        donating, (jax.tree.map(lambda x: x.copy(), state), target, proposer), calls, rounds, threaded=True
    )
    return {"arrays": counts, "us_a_call": rows, "device": str(jax.devices()[0].device_kind)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="models/tiny-target")
    p.add_argument("--draft", default="models/tiny-dflash")
    p.add_argument("--num-slots", type=int, default=16)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    target = load_target(args.target)
    spec = SpecConfig(verify_mode="static", num_slots=args.num_slots, max_len=512, block_size=8, trim_draft=True)
    result = measure(Engine(target, load_draft(args.draft, target), spec), args.calls, args.rounds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "arg_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}; arrays {result['arrays']}")
    for row, us in result["us_a_call"].items():
        print(f"{row}: {us:.1f} us a call")
    return result


if __name__ == "__main__":
    main()
