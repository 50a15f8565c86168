"""Test set-up: 8 simulated CPU devices, fixed before JAX starts its backend."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
