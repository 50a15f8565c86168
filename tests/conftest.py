"""Test set-up: 8 simulated CPU devices, fixed before JAX starts its backend."""
import os
import signal
import sys

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
# The suite's XLA:CPU flags (tests/suite_xla.py: -O0 machine code, classic loop emitters, one
# LLVM module a program); child processes inherit them.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite_xla  # noqa: E402

os.environ["XLA_FLAGS"] = suite_xla.xla_flags(os.environ.get("XLA_FLAGS", ""))
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
