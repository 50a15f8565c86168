"""make_mesh: sizes by name, -1 for the rest, clear errors."""

import jax
import pytest

import jaxpar
from jaxpar.mesh import resolve_axes


def test_rest_axis_and_names():
    mesh = jaxpar.make_mesh({"data": 2, "model": -1})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_names == ("data", "model")
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_from_config_and_device_subset():
    cfg = jaxpar.ParallelConfig(mesh={"data": 4})
    mesh = jaxpar.make_mesh(cfg, devices=jax.devices()[:4])
    assert mesh.devices.size == 4


@pytest.mark.parametrize("axes, n, words", [
    ({"data": 3}, 8, ["3 devices", "8 are available", "-1"]),
    ({"data": 3, "model": -1}, 8, ["multiply to 3", "does not divide"]),
])
def test_wrong_product(axes, n, words):
    with pytest.raises(ValueError) as e:
        resolve_axes(axes, n)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_smaller_mesh_than_the_devices_names_the_subset_to_pass():
    with pytest.raises(ValueError, match=r"has 4 devices but 8 are available.*; or, to run on 4 of them, pass "
                                         r"devices=jax.devices\(\)\[:4\]"):
        jaxpar.make_mesh({"data": 2, "model": 2})
    with pytest.raises(ValueError) as e:                 # more than there are: no subset to offer
        jaxpar.make_mesh({"data": 16})
    assert "devices=" not in str(e.value)


def test_type_error():
    with pytest.raises(TypeError, match="ParallelConfig or a mapping"):
        jaxpar.make_mesh([2, 4])
