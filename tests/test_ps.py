"""Parameter servers: sync training equals the in-process table; bad input fails fast.

Servers run as subprocesses on loopback (``tests/workers/ps_servers.py``), under the timeouts
of the client calls and of pytest.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar import ps
from workers.ps_servers import Servers, free_port

DIM = 8
USERS = ps.TableSpec("users", 2000, DIM, ps.SGD(0.5), partition="range", seed=1)
ITEMS = ps.TableSpec("items", 3000, DIM, ps.Adagrad(0.1), partition="hash", seed=2)
# Two fields read one shared table: a user's current and previous item.
FIELDS = {"user": "users", "item": "items", "prev": "items"}
TOKEN = "test-token-1234"


class Tower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(3 * DIM, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))[..., 0]


def loss_fn(model, emb, batch):
    x = jnp.concatenate([emb["user"], emb["item"], emb["prev"]], axis=-1)
    return optax.sigmoid_binary_cross_entropy(model(x), batch["label"]).mean()


def make_batches(n, size=32, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        # Few distinct ids: duplicates inside a field and across the two item fields.
        user = rng.integers(0, 300, size)
        item = rng.integers(0, 200, size)
        prev = rng.integers(0, 200, size)
        label = ((user + item) % 3 == 0).astype(np.float32)
        out.append({"user": user, "item": item, "prev": prev, "label": label})
    return out


def reference(batches):
    """The same model with both tables as nnx.Params on one device, trained by optax."""
    tower = Tower(nnx.Rngs(0))
    graphdef, params = nnx.split(tower)
    tables = {"users": jnp.asarray(ps.init_rows(USERS, np.arange(USERS.rows))),
              "items": jnp.asarray(ps.init_rows(ITEMS, np.arange(ITEMS.rows)))}
    txs = {"tower": optax.sgd(0.05), "users": optax.sgd(0.5),
           "items": optax.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-10)}
    state = {"tower": params, **tables}
    opt = {k: tx.init(state[k]) for k, tx in txs.items()}

    @jax.jit
    def step(state, opt, batch):
        def loss(state):
            emb = {f: state[t][batch[f]] for f, t in FIELDS.items()}
            return loss_fn(nnx.merge(graphdef, state["tower"]), emb, batch)

        value, grads = jax.value_and_grad(loss)(state)
        new_state, new_opt = {}, {}
        for k, tx in txs.items():
            updates, new_opt[k] = tx.update(grads[k], opt[k], state[k])
            new_state[k] = optax.apply_updates(state[k], updates)
        return new_state, new_opt, value

    losses = []
    for batch in batches:
        state, opt, value = step(state, opt, batch)
        losses.append(float(value))
    return losses, state


@pytest.fixture
def servers(tmp_path, tag):
    s = Servers(tmp_path, tag, count=2, token=TOKEN)
    yield s
    s.stop()


def test_sync_two_servers_equals_in_process_table(servers):
    batches = make_batches(20)
    want_losses, want = reference(batches)
    client = ps.connect([USERS, ITEMS], addresses=servers.addresses, token=TOKEN, timeout=30,
                        worker=0, workers=1)
    trainer = ps.SparseTrainer(client, Tower(nnx.Rngs(0)), optax.sgd(0.05), loss_fn, FIELDS, prefetch=True)
    got_losses = [h["loss"] for h in trainer.fit(batches)]
    np.testing.assert_allclose(got_losses, want_losses, rtol=0, atol=1e-6)
    rows = client.pull_many({"users": np.arange(USERS.rows), "items": np.arange(ITEMS.rows)}, step=20)
    np.testing.assert_allclose(rows["users"], want["users"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(rows["items"], want["items"], rtol=0, atol=1e-6)
    assert np.abs(rows["items"] - ps.init_rows(ITEMS, np.arange(ITEMS.rows))).max() > 1e-3  # it trained
    got_tower = jax.tree.leaves(nnx.state(trainer.model))
    for g, w in zip(got_tower, jax.tree.leaves(want["tower"])):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
    stats = client.stats()
    assert stats["tables"]["items"]["clock"] == 20 and stats["tables"]["items"]["rejected"] == 0
    client.close()
    assert servers.stop() == [0, 0]  # SIGTERM: a final checkpoint, then exit 0


def test_bad_input_fails_fast_with_names(servers):
    client = ps.connect([USERS], addresses=servers.addresses, token=TOKEN, timeout=5, worker=0, workers=1)
    with pytest.raises(ValueError, match=r"table 'users': 1 ids outside \[0, 2000\), e.g. 2000"):
        client.pull("users", np.array([1, 2000]), step=0)
    with pytest.raises(ValueError, match=r"table 'users': 1 ids outside \[0, 2000\), e.g. -1"):
        client.pull("users", np.array([-1]), step=0)
    with pytest.raises(TypeError, match=r"table 'users': ids of dtype float32"):
        client.pull("users", np.array([1.0], np.float32), step=0)
    with pytest.raises(ValueError, match=r"unknown table 'usres'; this client's tables are \['users'\]"):
        client.pull("usres", np.array([1]), step=0)
    with pytest.raises(ValueError, match=r"table 'users': gradients of shape \[1, 3\] for 1 ids; expected \[1, 8\]"):
        client.push("users", np.array([1]), np.zeros((1, 3)), step=0)
    client.close()
    start = time.monotonic()
    with pytest.raises(PermissionError, match="wrong job token") as e:
        ps.connect([USERS], addresses=servers.addresses, token="not-the-token", timeout=5, worker=0, workers=1)
    assert TOKEN not in str(e.value) and "not-the-token" not in str(e.value)
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=rf"parameter server {dead} did not answer 'hello' .*timeout=1.0 s"):
        ps.connect([USERS], addresses=[dead], token=TOKEN, timeout=1.0, worker=0, workers=1)
    assert time.monotonic() - start < 5
    other = ps.TableSpec("users", 999, DIM, ps.SGD(0.5))
    with pytest.raises(ValueError, match="table 'users' exists here as"):
        ps.connect([other], addresses=servers.addresses, token=TOKEN, timeout=5, worker=0, workers=1)
    with pytest.raises(ValueError, match="staleness=2 with mode='sync'"):
        ps.connect([USERS], addresses=servers.addresses, token=TOKEN, staleness=2)
