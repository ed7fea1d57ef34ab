"""Kernel benchmarks on the GPU, all in one process tree so the ratios are measured in one run.

Runs, in order (each writes its table under --out): the GDN replay verify (bench/gdn_verify_kernel.py)
and the conv verify (bench/conv_kernel.py) at each window length of --ts (8 and 16), the fold
(bench/fold_kernel.py), and, when the fla-core wheel and ../shared/anchors/fla_gdn_bench.py are
carried in .carry/, flash-linear-attention's GDN kernels at each T in their own process (JAX
preallocates GPU memory). --jobs picks a subset. Usage on the device machine:

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/kernels.py --out $OUT
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(cmd, log, env=None, timeout=None):
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[timed out after {timeout} s]\n")
            return 124


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "out")))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--ts", default="8,16", help="window lengths T of the verify and conv benchmarks")
    ap.add_argument("--jobs", default="verify,conv,fold,fla", help="which benchmarks to run")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per benchmark")
    args = ap.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    py = sys.executable
    ts = args.ts.split(",")
    jobs = [(f"verify_T{t}", "verify", [py, os.path.join(HERE, "gdn_verify_kernel.py"), "--ts", t, "--hists", "0,8",
                                        "--batches", args.batches, "--ref-batches", "1,128"]) for t in ts]
    jobs += [(f"conv_T{t}", "conv", [py, os.path.join(HERE, "conv_kernel.py"), "--batches", args.batches, "--T", t,
                                     "--budget-s", "60"]) for t in ts]
    jobs += [("fold", "fold", [py, os.path.join(HERE, "fold_kernel.py"), "--batches", args.batches])]
    chosen = set(args.jobs.split(","))
    jobs = [(name, cmd) for name, kind, cmd in jobs if kind in chosen]
    status = 0
    for name, cmd in jobs:
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        status |= _run(cmd + ["--out", out], os.path.join(out, "log.txt"), env, args.timeout) != 0
    wheels = glob.glob(os.path.join(ROOT, ".carry", "whl", "fla_core-*.whl"))
    anchor = os.path.join(ROOT, ".carry", "anchors", "fla_gdn_bench.py")
    if "fla" in chosen and wheels and os.path.exists(anchor):
        site = tempfile.mkdtemp()
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site] + wheels,
                       check=True)
        for t in ts:
            _run([py, anchor, "--batches", args.batches, "--T", t], os.path.join(args.out, f"fla_T{t}.jsonl"),
                 dict(os.environ, PYTHONPATH=site), args.timeout)
    return status


if __name__ == "__main__":
    sys.exit(main())
