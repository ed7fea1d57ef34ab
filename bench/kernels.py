"""`make bench`: the kernel benchmarks on one GPU, each job in its own process with its own directory and timeout.

Every ratio in a job's table is measured in that one run.

Jobs, in run order (--jobs picks kinds; verify, conv and fla run once per T of --ts):
  fla        flash-linear-attention's GDN kernels (.carry/anchors/fla_gdn_bench.py with the fla-core
             wheel in .carry/whl/; skipped without them), torch only: its rows go into verify's table
  verify     GDN replay verify, bench/gdn_verify_kernel.py
  conv       conv verify, bench/conv_kernel.py
  fold       GDN fold, bench/fold_kernel.py
  prefill    chunked GDN prefill, bench/prefill_chunk.py
  attention  verify attention, bench/attention_kernel.py
  topk       top-k, bench/topk_kernel.py
  estimator  the acceptance estimator's per-step work, bench/estimator_step.py
Before them, the torch copy bandwidth is measured in a process of its own and its file put in every
job's directory: each job's floors divide by the faster of it and the job's own JAX copy. A job is
killed at its timeout (TIMEOUT_S x --scale; its directory keeps what it wrote); the JAX jobs start
no new case after BUDGET_SHARE of it. The default timeouts, T 8, add up to 10 minutes.

Usage (GPU): python3 bench/kernels.py --out $OUT [--jobs verify,conv] [--ts 8,16]   (or `make bench`)
Writes DIR/JOB/log.txt and the job's own files, and DIR/summary.json (a job's status and seconds).
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
ANCHOR = os.path.join(benchutil.ROOT, ".carry", "anchors", "fla_gdn_bench.py")
WHEELS = os.path.join(benchutil.ROOT, ".carry", "whl", "fla_core-*.whl")
KINDS = ("fla", "verify", "conv", "fold", "prefill", "attention", "topk", "estimator")
TIMEOUT_S = dict(torch=30, fla=45, verify=150, conv=60, fold=70, prefill=60, attention=90, topk=50, estimator=45)
BUDGET_SHARE = 0.75


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    ap.add_argument("--jobs", default=",".join(KINDS), help="kinds to run, of " + ",".join(KINDS))
    ap.add_argument("--ts", default="8", help="window lengths T of the fla, verify and conv jobs")
    ap.add_argument("--batches", default="1,8,32,128", help="batches of the fla, verify, conv and fold jobs")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every timeout (and case budget) by this")
    args = ap.parse_args(argv)
    unknown = set(args.jobs.split(",")) - set(KINDS)
    if unknown:
        ap.error(f"--jobs: unknown {sorted(unknown)}; kinds: {','.join(KINDS)}")
    return args


def job_list(args):
    """[(name, kind, command)] in run order; a JAX job's command gets --out and --budget-s later."""
    script = lambda name, *flags: [sys.executable, os.path.join(HERE, name), *flags]
    jobs = []
    for t in args.ts.split(","):
        fla_log = os.path.join(args.out, f"fla_T{t}", "log.txt")
        jobs += [
            (f"fla_T{t}", "fla", [sys.executable, ANCHOR, "--batches", args.batches, "--T", t]),
            (
                f"verify_T{t}",
                "verify",
                script(
                    "gdn_verify_kernel.py",
                    "--ts",
                    t,
                    "--hists",
                    "0,8",
                    "--batches",
                    args.batches,
                    "--ref-batches",
                    "1,128",
                    "--fla",
                    fla_log,
                ),
            ),
            (f"conv_T{t}", "conv", script("conv_kernel.py", "--T", t, "--batches", args.batches)),
        ]
    jobs += [
        ("fold", "fold", script("fold_kernel.py", "--batches", args.batches)),
        ("prefill", "prefill", script("prefill_chunk.py", "--cases", "1x4096,4x4096", "--reps", "5", "--iters", "3")),
        ("attention", "attention", script("attention_kernel.py", "--reps", "5", "--xla-reps", "3")),
        (
            "topk",
            "topk",
            script("topk_kernel.py", "--no-adversarial", "--reps", "5", "--inner", "3", "--xla-reps", "2"),
        ),
        ("estimator", "estimator", script("estimator_step.py", "--reps", "5")),
    ]
    chosen = args.jobs.split(",")
    return [job for job in jobs if job[1] in chosen]


def run(cmd, out_dir, env, timeout):
    """Run cmd with stdout and stderr in out_dir/log.txt; its exit status, 124 at the timeout."""
    os.makedirs(out_dir, exist_ok=True)
    print("+", " ".join(cmd), flush=True)
    with open(os.path.join(out_dir, "log.txt"), "w") as log:
        try:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[timed out after {timeout:.0f} s]\n")
            return 124


def main(args):
    env = dict(os.environ, PYTHONPATH=benchutil.ROOT, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    backend = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env, capture_output=True, text=True
    ).stdout.strip()
    if backend != "gpu":
        print(
            f"bench/kernels.py: JAX's backend is {backend or 'not importable'}, not gpu: run it with a Python "
            "whose jax has CUDA (pip install -e '.[cuda]', or `make bench PY=python3` on the GPU machine)",
            file=sys.stderr,
        )
        return 2
    summary = []

    def record(name, rc, start):
        summary.append(dict(job=name, rc=rc, seconds=round(time.time() - start, 1)))
        print(f"  {name}: rc {rc}, {summary[-1]['seconds']} s", flush=True)

    start = time.time()
    torch_dir = os.path.join(args.out, "torch_copy")
    rc = run(
        [sys.executable, "-c", "import sys, benchutil; benchutil.torch_copy_bandwidth(sys.argv[1])", torch_dir],
        torch_dir,
        dict(env, PYTHONPATH=HERE),
        TIMEOUT_S["torch"] * args.scale,
    )
    record("torch_copy", rc, start)
    torch_json = os.path.join(torch_dir, benchutil.TORCH_COPY_JSON)
    wheels = glob.glob(WHEELS)
    site = None
    for name, kind, cmd in job_list(args):
        start, out_dir = time.time(), os.path.join(args.out, name)
        timeout = TIMEOUT_S[kind] * args.scale
        if kind == "fla":
            if not (wheels and os.path.exists(ANCHOR)):
                print(f"  {name}: skipped (no {os.path.relpath(ANCHOR, benchutil.ROOT)} or fla-core wheel)")
                continue
            if site is None:
                site = tempfile.mkdtemp()
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "install",
                        "-q",
                        "--no-index",
                        "--no-deps",
                        "--target",
                        site,
                        *wheels,
                    ],
                    check=True,
                )
            rc = run(cmd, out_dir, dict(os.environ, PYTHONPATH=site), timeout)
        else:
            os.makedirs(out_dir, exist_ok=True)
            if os.path.exists(torch_json):
                shutil.copy(torch_json, out_dir)
            rc = run(cmd + ["--out", out_dir, "--budget-s", str(BUDGET_SHARE * timeout)], out_dir, env, timeout)
        record(name, rc, start)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return int(any(s["rc"] for s in summary[1:]))  # a failed torch copy only costs the torch floor


if __name__ == "__main__":
    sys.exit(main(parse()))
