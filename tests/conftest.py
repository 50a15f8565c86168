"""Test set-up: 8 simulated CPU devices, fixed before JAX starts its backend."""
import os
import signal

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the run: this process, the xdist workers and every child
# process a test starts (they inherit the environment). The suite compiles the same tiny
# programs many times over (one-device references, restarted workers); a hit loads the
# executable instead of compiling it again. `make test` empties it first, so a run's time is
# that of a fresh machine.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite compiles hundreds of small programs and runs each for a few steps: the machine
# code's quality buys nothing here, its compile time is most of the suite's. So LLVM optimises
# at -O0 (its passes were about 45 % of each compile's CPU time), and XLA:CPU emits fused
# loops with its classic element-wise emitters instead of its MLIR fusion emitters (a third
# less backend compile time — 5.2 s against 9.8 s for three of the matrix's steps — with the
# same run time, and temp bytes within 320 of 0.7-2.3 MB: `python benchmarks/suite_flags.py`,
# benchmarks/results/suite_flags.json). The HLO passes — sharding propagation, the SPMD
# partitioner, collectives — run as in production; only the machine code is made another way.
# Child processes inherit the flags.
_SUITE_XLA_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{k}={v}" for k, v in _SUITE_XLA_FLAGS.items() if k not in _flags]).strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


def requires_devices(n: int):
    """Skip marker for tests that need at least ``n`` devices."""
    return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices")


@pytest.fixture
def tag():
    """A unique mark for a multi-process test's processes; none may outlive the test."""
    from workers.procs import kill_tagged, new_tag, wait_gone

    mark = new_tag()
    yield mark
    left = wait_gone(mark, timeout=10)
    kill_tagged(mark)
    assert not left, f"processes left behind: {left}"


def pytest_configure(config):
    """Under ``-n``, xdist hands a worker one test at a time as it frees up (``--maxschedchunk 1``;
    its default hands each worker a quarter of its share up front: the slow tests, sorted first,
    all went to one worker, which ran 8 minutes after the other had finished), and keeps the
    tests of one ``xdist_group`` on one worker (``--dist loadgroup``): a module whose tests share
    a costly module-scoped fixture marks itself so, and the fixture is built once, not once per
    worker (test_zero's and test_pipeline_v's took 23 s each, twice). Groups keep their place in
    the slow-first order (no reordering by size). Set here rather than in pyproject's addopts, so
    that pytest runs without xdist too (``-p no:xdist``, or an install without the dev extra);
    a ``--dist`` other than ``load`` (what ``-n`` alone gives) wins."""
    if getattr(config.option, "maxschedchunk", 0) is None:     # xdist is loaded, the flag not given
        config.option.maxschedchunk = 1
    if getattr(config.option, "dist", None) == "load":         # -n without --dist
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Long tests first (a stable sort on the ``slow`` mark): the xdist workers are handed tests
    one at a time in this order (``--maxschedchunk 1``, `pytest_configure`), so the short ones fill
    the end of the run instead of one worker finishing a minutes-long test while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def default_sigterm():
    """SIGTERM at its default action for the test, so that a Trainer installs its handler, with
    no Trainer of an earlier test listening (one never closed would until garbage collected);
    after it, the same cleared and SIGTERM's handler put back."""
    from jaxpar.train import hooks

    def quiet():
        for listener in list(hooks._listening):
            listener.close()

    quiet()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        quiet()
        signal.signal(signal.SIGTERM, previous)
