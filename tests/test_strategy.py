"""Strategy forms → PartitionSpec: integer tuples, Layout, logical names + rules, PartitionSpec."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import Layout, to_partition_spec

SIZES = {"data": 2, "model": 4}


@pytest.mark.parametrize("strategy, expected", [
    ((2, 1), P("data", None)),
    ((1, 4), P(None, "model")),
    ((2, 4), P("data", "model")),
    ((4, 2), P("model", "data")),
    ((8, 1), P(("data", "model"), None)),
    ((1, 1), P(None, None)),
])
def test_integer_tuples(strategy, expected):
    assert to_partition_spec(strategy, SIZES, (16, 16)) == expected


def test_integer_rule_prefers_exact_axis_then_products_in_mesh_order():
    sizes = {"a": 2, "b": 2, "c": 4}
    assert to_partition_spec((4, 1), sizes) == P("c", None)           # exact size wins
    assert to_partition_spec((2, 2), sizes) == P("a", "b")            # first unused axis
    assert to_partition_spec((4, 4), sizes) == P("c", ("a", "b"))      # then a product
    assert to_partition_spec((16,), sizes) == P(("a", "b", "c"))


def test_layout_forms():
    layout = Layout((2, 4), ("data", "model"))
    assert to_partition_spec(layout("data", "None"), SIZES) == P("data", None)
    assert to_partition_spec(layout(("data", "model"), None), SIZES) == P(("data", "model"), None)
    layout3 = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert layout3("dp", ("sp", "mp")).to_partition_spec() == P("dp", ("sp", "mp"))
    mesh = layout3.mesh()
    assert to_partition_spec(layout3("dp", ("sp", "mp")), mesh, (4, 8)) == P("dp", ("sp", "mp"))


def test_logical_names_and_rules():
    rules = {"embed": None, "mlp": "model", "batch": ("data",), "both": ("data", "model")}
    assert to_partition_spec(("embed", "mlp"), SIZES, rules=rules) == P(None, "model")
    assert to_partition_spec(("batch", None), SIZES, rules=rules) == P("data", None)
    assert to_partition_spec(("both",), SIZES, rules=rules) == P(("data", "model"))
    assert to_partition_spec(("unknown", "model"), SIZES, rules={}) == P(None, "model")


def test_partition_spec_is_returned_as_is():
    spec = P("data", None)
    assert to_partition_spec(spec, SIZES, (4, 4)) is spec


def test_same_split_same_spec_in_every_form():
    layout = Layout((2, 4), ("data", "model"))
    forms = [(2, 4), layout("data", "model"), ("batch", "mlp"), P("data", "model")]
    specs = {to_partition_spec(f, SIZES, (8, 8), rules={"batch": "data", "mlp": "model"}) for f in forms}
    assert specs == {P("data", "model")}


@pytest.mark.parametrize("strategy, shape, words", [
    ((3, 1), (6, 4), ["no unused mesh axes multiply to 3", "(6, 4)"]),
    ((2, 1), (5, 4), ["factor 2 does not divide dimension 0 of size 5"]),
    ((4, 4), (8, 8), ["multiply to at most the 8 devices"]),
    ((2,), (4, 4), ["1 entries", "2 dimensions"]),
    (P("data", "data"), (4, 4), ["'data' splits two dimensions"]),
    (P("tensor"), (4,), ["'tensor' is not in the mesh"]),
    (P(None, "model"), (4, 6), ["size 6 is not divisible by 4"]),
])
def test_impossible_strategies(strategy, shape, words):
    with pytest.raises(ValueError) as e:
        to_partition_spec(strategy, SIZES, shape)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "mesh" in str(e.value)


def test_layout_errors():
    with pytest.raises(ValueError, match="alias 'dp' is used on two dimensions"):
        Layout((2, 4), ("dp", "mp"))("dp", "dp")
    with pytest.raises(ValueError, match="not an alias"):
        Layout((2, 4), ("dp", "mp"))("sp", None)
    with pytest.raises(ValueError, match="does not match the mesh"):
        to_partition_spec(Layout((4, 2), ("data", "model"))("data", None), SIZES)
    with pytest.raises(TypeError, match="call it with one entry per tensor dimension"):
        to_partition_spec(Layout((2, 4), ("data", "model")), SIZES)
    with pytest.raises(ValueError, match="'mlp' maps to mesh axis 'tensor', which is not in the mesh"):
        to_partition_spec(("mlp",), SIZES, rules={"mlp": "tensor"})


def test_not_a_strategy():
    with pytest.raises(TypeError, match="is not a strategy"):
        to_partition_spec(3.5, SIZES)


@pytest.mark.parametrize("size", [2.5, -4, 0, True, "4"])
def test_mesh_sizes_refuses_a_size_that_is_not_a_whole_positive_number(size):
    """A mapping given as a mesh (the plan, the search and the cost model take one) names the
    axis and the size; ``int()`` made 2.5 into 2 and left -4 to fail far from the mistake."""
    from jaxpar.strategy import mesh_sizes

    with pytest.raises(ValueError, match=r"mesh axis 'data': size .* is not a whole number of devices"):
        mesh_sizes({"data": size, "model": 2})
    assert mesh_sizes({"data": np.int64(4), "model": 2.0}) == {"data": 4, "model": 2}
