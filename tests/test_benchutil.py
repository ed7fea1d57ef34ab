"""bench/benchutil.setup_jax: a GPU benchmark refuses to time a CPU backend (JAX falls back to the CPU
with only a warning when its CUDA plugin fails), and lifts the allocator's default 75% memory fraction
unless the caller set one (under either name)."""

import json
import os
import subprocess
import sys

import child
import pytest

PROBE = """
import json, os, sys
sys.path.insert(0, os.path.join({root!r}, "bench"))
import benchutil
benchutil.setup_jax({smoke}, require_gpu={require_gpu})
names = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")
print(json.dumps({{name: os.environ.get(name) for name in names}}))
"""


def probe(*, smoke, require_gpu=None, env=()):
    base = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k and k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(root=child.ROOT, smoke=smoke, require_gpu=require_gpu)],
        env={**base, "JAX_PLATFORMS": "cpu", **dict(env)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cpu_backend_is_refused_for_a_gpu_run():
    result = probe(smoke=False)
    assert result.returncode != 0
    assert "backend is 'cpu', not a GPU" in result.stderr and "--smoke" in result.stderr
    assert result.stdout == ""  # exited before the script went on


@pytest.mark.parametrize("smoke, require_gpu", [(True, None), (False, False)], ids=["smoke", "compile-only"])
def test_cpu_backend_allowed_where_asked(smoke, require_gpu):
    result = probe(smoke=smoke, require_gpu=require_gpu)
    assert result.returncode == 0, result.stderr[-2000:]
    env = json.loads(result.stdout)
    assert env == {
        "XLA_CLIENT_MEM_FRACTION": "0.95",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": None,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }


@pytest.mark.parametrize("name", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
def test_a_given_memory_fraction_is_kept_alone(name):
    """Setting both names makes jaxlib's CUDA plugin fail (and JAX fall back to the CPU)."""
    result = probe(smoke=True, env={name: "0.5"})
    assert result.returncode == 0, result.stderr[-2000:]
    env = json.loads(result.stdout)
    other = {"XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"} - {name}
    assert env[name] == "0.5" and env[other.pop()] is None
