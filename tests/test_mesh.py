"""make_mesh: sizes by name, -1 for the rest, clear errors."""

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar import ParallelConfig, make_mesh
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


# ----------------------------------------------------------------------------- two networks

def _fake_devices(processes: int, per_process: int):
    from types import SimpleNamespace
    return [SimpleNamespace(platform="cpu", device_kind="cpu", id=i, process_index=i // per_process,
                            slice_index=None) for i in range(processes * per_process)]


def test_hosts_field_is_validated_and_loads_like_the_other_fields():
    cfg = ParallelConfig(mesh={"data": 4, "model": 2}, hosts={"data": 2, "model": 1})
    assert cfg.hosts == {"data": 2}                        # a factor of 1 is the default
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert ParallelConfig.from_overrides(["--mesh", "data=4,model=2", "--hosts", "data=2"]) == cfg
    assert ParallelConfig(mesh={"data": -1}, hosts={"data": 2}).hosts == {"data": 2}   # checked by make_mesh
    for hosts, match in (({"pipe": 2}, "'pipe' is not in the mesh"), ({"data": 3}, "3 does not divide 4"),
                         ({"data": 0}, "positive int"), ([2], "give a mapping")):
        with pytest.raises(ValueError, match=match):
            ParallelConfig(mesh={"data": 4, "model": 2}, hosts=hosts)


def test_hybrid_devices_keep_inner_factors_inside_a_host():
    from jaxpar.mesh import hybrid_devices

    devices = _fake_devices(2, 4)
    host = np.vectorize(lambda d: d.process_index)
    # data = 2 hosts x 2 inside: every model pair on one host; data's groups cross
    grid = host(hybrid_devices({"data": 4, "model": 2}, {"data": 2}, devices))
    assert all(len(set(row)) == 1 for row in grid) and len(set(grid[:, 0])) == 2
    grid = host(hybrid_devices({"data": 2, "model": 4}, {"model": 2}, devices))
    assert all(len(set(col)) == 1 for col in grid.T) and len(set(grid[0])) == 2
    with pytest.raises(ValueError, match=r"asks for 4 hosts of 2 devices each, but the 8 devices are on 2 "
                                         r"processes \(hosts\) of 4 devices"):
        hybrid_devices({"data": 4, "model": 2}, {"data": 4}, devices)
    with pytest.raises(ValueError, match="3 does not divide 4"):
        hybrid_devices({"data": 4, "model": 2}, {"data": 3}, devices)


def test_hosts_on_one_process_is_refused_and_no_hosts_keeps_the_mesh():
    from jaxpar.mesh import host_map

    with pytest.raises(ValueError, match="on 1 process .host. of 8 devices; make the hosts factors multiply to 1"):
        make_mesh(ParallelConfig(mesh={"data": 2, "model": -1}, hosts={"data": 2}))
    plain = make_mesh(ParallelConfig(mesh={"data": 2, "model": -1}))
    assert plain.devices.tolist() == make_mesh({"data": 2, "model": 4}).devices.tolist()
    assert host_map(plain) == {}
