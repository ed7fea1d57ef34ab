"""Child processes of the tests: a test module run again in a child pytest, and a benchmark
script's CPU smoke run.

For modules that need an XLA backend of their own (test_parallel: four CPU devices, a flag XLA
reads once per process) or that XLA:CPU has crashed under inside the full suite (test_spec_modes:
jax 0.11.2's CPU backend aborted or segfaulted there intermittently, never when the module ran
alone). The parent test runs the child and asserts on its verdict; a child killed by a signal
(returncode < 0: the crash, not a failed test) may be run again `crash_retries` times, with a
warning naming the signal. A failed test is never rerun.
"""

import os
import subprocess
import sys
import warnings

CHILD_ENV = "JAXSPEC_TEST_CHILD"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_child() -> bool:
    """Whether this process is a child started by `run_module`."""
    return os.environ.get(CHILD_ENV) == "1"


O0 = "--xla_backend_optimization_level=0"


def with_xla_flags(*flags) -> dict:
    """{"XLA_FLAGS": this process's XLA_FLAGS with `flags` added}, for `run_module`'s extra_env."""
    return {"XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()}


def run_module(path, *, extra_env=None, crash_retries=0, timeout=1800) -> subprocess.CompletedProcess:
    """pytest -q on `path` in a child process (CHILD_ENV set, `extra_env` added); its result.

    The child modules are mostly compilation (engines of many configurations, tiny models): with
    XLA:CPU codegen at -O0 (`with_xla_flags(O0)`) test_parallel took 403 s instead of 571 and
    test_spec_modes 358 instead of 540 (2 cores, 2026-12-07). A module that mostly executes (the
    sampling tests' thousands of requests) runs slower at -O0: 251 s -> over 330."""
    env = {**os.environ, CHILD_ENV: "1", **(extra_env or {})}
    for attempt in range(crash_retries + 1):
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", path],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode >= 0:
            break
        warnings.warn(
            f"{os.path.basename(path)}: the child pytest died of signal {-result.returncode} "
            f"(attempt {attempt + 1} of {crash_retries + 1})",
            stacklevel=2,
        )
    return result


def verdict(result) -> str:
    """The end of a child's output, for an assertion message."""
    return result.stdout[-6000:] + result.stderr[-3000:]


def run_smoke(script, *args, timeout) -> subprocess.CompletedProcess:
    """`bench/<script>` with `args` (its --smoke, --out ...) on the CPU in a child process, from the
    repository root, XLA:CPU codegen at -O0 (a smoke run is mostly compilation; the code path is the
    same) and no $OUT inherited; asserts that it exited 0 and returns its result."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip(),
    )
    env.pop("OUT", None)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", script), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result
