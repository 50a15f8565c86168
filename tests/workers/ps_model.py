"""The tiny two-table click model the parameter-server tests train, and its in-process reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar import ps

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


@functools.lru_cache(maxsize=2)
def reference(n=20):
    """The same model with both tables as nnx.Params on one device, trained by optax on
    ``make_batches(n)``: (losses, final state)."""
    batches = make_batches(n)
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


def trainer_for(client, config=None, **options):
    """A jaxpar.Trainer of the tower whose tables are the servers' (one device without ``config``)."""
    config = config or jaxpar.ParallelConfig(mesh={"data": 1})
    source = ps.ServerRows(client, FIELDS)
    mesh = jaxpar.make_mesh(config, devices=jax.devices()[:int(np.prod(list(config.mesh.values())))])
    return source, jaxpar.Trainer(Tower(nnx.Rngs(options.pop("seed", 0))), optax.sgd(0.05),
                                  lambda model, batch, rows: loss_fn(model, source.embedded(batch, rows), batch),
                                  config, mesh, rows=source, **options)


def mesh_trainer(client, config):
    """``(source, trainer)``: the tower's jaxpar.Trainer on ``config``'s mesh of every device of the
    job, its rows pulled by ServerRows as global arrays on that mesh (what a job of several
    processes needs: each process pulls and pushes the rows of its own part of the batch)."""
    mesh = jaxpar.make_mesh(config)
    source = ps.ServerRows(client, FIELDS, mesh=mesh)
    return source, jaxpar.Trainer(jaxpar.init(lambda: Tower(nnx.Rngs(0)), config, mesh), optax.sgd(0.05),
                                  lambda model, batch, rows: loss_fn(model, source.embedded(batch, rows), batch),
                                  config, mesh, rows=source)
