"""The suite's own set-up: it runs with or without pytest-xdist."""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_with_xdist_a_worker_is_handed_one_test_at_a_time(request):
    """conftest.py sets xdist's ``--maxschedchunk 1`` when xdist is loaded and it is not given."""
    if not request.config.pluginmanager.hasplugin("xdist"):
        assert not hasattr(request.config.option, "maxschedchunk")
        return
    if any(a.startswith("--maxschedchunk") for a in request.config.invocation_params.args):
        return      # given on the command line: it wins
    assert request.config.getoption("maxschedchunk") == 1


def test_the_suite_runs_without_xdist():
    """pyproject's addopts name no xdist flag, and no test needs an xdist fixture: ``pytest -p
    no:xdist`` (or an install without the dev extra) collects and runs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                          "tests/test_config.py", "-k", "former_name"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout
