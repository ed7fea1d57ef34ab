"""One persistent XLA compilation cache for a whole test session, and no compiled program kept
from one test module to the next.

The suite is mostly XLA:CPU compilation, and many modules compile the same programs (the shipped
tiny models' engines, the same kernel cases): the xdist workers, the child pytest runs and the
bench smoke runs (`tests/child.py`) share one on-disk cache, so a program is compiled once per
session. The cache key is the program, the compile options, XLA_FLAGS and the jax/jaxlib versions,
so a hit is the same executable. `JAX_COMPILATION_CACHE_DIR` set by the caller is kept (a cache
that lives across sessions); otherwise the session makes a temporary one and removes it.

Every loaded XLA:CPU executable holds memory mappings of its own (about 20 for a small program,
hundreds for an engine step), and the jitted steps and prefills that engines share
(`step.jitted_step`, `step.jitted_prefill`) keep theirs for the life of the process: an xdist
worker that ran a few dozen modules held ~50,000 mappings, and at the kernel's limit
(vm.max_map_count, 65,530) the next compilation cannot map its code and the worker dies of a
segfault in `backend_compile_and_load`. So every module ends by dropping those factories and
jax's caches; a later module that compiles the same program reads it back from the disk cache.
"""

import gc
import json
import os
import shutil
import tempfile

import jax
import pytest
from jax._src import monitoring

from jaxspec import step

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
SESSION_ENV = "JAXSPEC_TEST_SESSION"
# the slowest modules, slowest first (worker seconds of a full run, 2026-12-08): `--dist loadfile`
# hands modules to the two workers in collection order, and a long module handed out last keeps
# one worker busy while the other idles
SLOWEST_FIRST = (
    "test_engine.py",
    "test_engine_sampling.py",
    "test_parallel.py",
    "test_spec_modes.py",
    "test_tier_dispatch.py",
    "test_cli.py",
    "test_bench_real_shape.py",
    "test_bench_e2e.py",
    "test_pallas_attention_verify.py",
    "test_target.py",
    "test_moe.py",
    "test_layer_groups.py",
    "test_pallas_gdn_verify.py",
    "test_fused.py",
    "test_train.py",
    "test_sampling.py",
)
_made_here = []
_stats = {"hits": 0, "misses": 0, "saved_s": 0.0}


def pytest_configure(config):
    # the controller runs first and its environment reaches the workers and the children
    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="jaxspec-xla-cache-")
        _made_here.append(os.environ[CACHE_ENV])
    os.environ.setdefault(SESSION_ENV, f"stats-{os.getpid()}-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # jax read its environment when this file imported it: this process is told directly
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    for option, kind in (("min_compile_time_secs", float), ("min_entry_size_bytes", int)):
        env = f"JAX_PERSISTENT_CACHE_{option.upper()}"
        jax.config.update(f"jax_persistent_cache_{option}", kind(os.environ[env]))
    _count_cache_events()


def pytest_collection_modifyitems(items):
    """The slowest modules first (longest first is the greedy schedule that best evens out two
    workers); the rest, and the tests within a module, keep their order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _count_cache_events():
    """Hits, misses and the compile seconds the hits saved, in this process."""
    names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}

    def on_event(event, **_):
        if event in names:
            _stats[names[event]] += 1

    def on_duration(event, seconds, **_):
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            _stats["saved_s"] += seconds

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)


def pytest_sessionfinish(session):
    """Each pytest process (worker, child) leaves its counts in the cache folder for the summary."""
    folder = os.environ[CACHE_ENV]
    if os.path.isdir(folder) and _stats["hits"] + _stats["misses"]:
        with open(os.path.join(folder, f"{os.environ[SESSION_ENV]}{os.getpid()}.json"), "w") as f:
            json.dump(_stats, f)


def pytest_terminal_summary(terminalreporter):
    """Summed only by the process that began the session (not a worker, not a child pytest, which
    would take the other processes' counts away from it)."""
    folder = os.environ.get(CACHE_ENV, "")
    if not os.path.isdir(folder) or os.environ[SESSION_ENV] != f"stats-{os.getpid()}-":
        return
    total = {"hits": 0, "misses": 0, "saved_s": 0.0}
    for name in os.listdir(folder):
        if name.startswith(os.environ[SESSION_ENV]):
            with open(os.path.join(folder, name)) as f:
                for key, value in json.load(f).items():
                    total[key] += value
            os.remove(os.path.join(folder, name))
    terminalreporter.write_line(
        f"XLA compilation cache ({folder}): {total['hits']} hits, {total['misses']} misses, "
        f"~{round(total['saved_s'])} s of compilation saved"
    )


def pytest_unconfigure(config):
    for folder in _made_here:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    step.jitted_step.cache_clear()
    step.jitted_prefill.cache_clear()
    jax.clear_caches()
    gc.collect()
