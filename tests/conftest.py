"""Four CPU devices for the tensor-parallel tests (tests/test_parallel.py). XLA reads the flag once,
when jax first starts a backend, so it is set here, before any test module imports jax; every
other test runs on device 0 as before."""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
