"""Parameter-server mistakes answered by name: a batch with keys of several types, timeouts of
any real type, and the server's command line and protocol (one line, exit 2, no traceback)."""

import math

import numpy as np
import pytest

from jaxpar import ps
from jaxpar.ps.worker import lookup

SPEC = ps.TableSpec("t", 10, 4, ps.SGD(0.1))


def test_a_missing_field_is_named_whatever_the_types_of_the_batch_keys():
    """sorted() of keys of several types raised TypeError while the error was being built."""
    with pytest.raises(ValueError, match=r"the batch has no ids for fields \['user'\] \(tables \['users'\]\); "
                                         r"its keys: \[3, 'item', 'label'\]"):
        lookup({"item": np.array([1]), 3: np.zeros(1), "label": np.zeros(1)}, {"user": "users"})


@pytest.mark.parametrize("timeout", [np.float32(0.3), np.float16(0.3), np.int64(1), 0.3])
def test_connect_takes_a_timeout_of_any_real_type(timeout):
    """np.float32(3) was refused where np.float64 was taken: here the call runs to its deadline
    (no server listens) and the message gives the timeout as a plain number."""
    with pytest.raises(TimeoutError, match=rf"did not answer 'hello' on table '\*' within timeout={float(timeout)} s"):
        ps.connect([SPEC], addresses=["127.0.0.1:9"], token="x", timeout=timeout, worker=0, workers=1)


@pytest.mark.parametrize("timeout", [0, -1.0, np.float32(-2), math.inf, math.nan, np.float32("nan"), True,
                                     np.bool_(True), "3", None])
def test_connect_refuses_a_timeout_that_is_not_positive_and_finite_by_name(timeout):
    with pytest.raises(ValueError, match=r"connect: timeout=.* must be a positive finite number of seconds"):
        ps.connect([SPEC], addresses=["127.0.0.1:9"], token="x", timeout=timeout, worker=0, workers=1)
