"""Parameter servers: sync training equals the in-process table; bad input fails fast.

Servers run as subprocesses on loopback (``tests/workers/ps_servers.py``), under the timeouts
of the client calls and of pytest.
"""

import json
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar import ps
from workers.ps_model import DIM, FIELDS, ITEMS, TOKEN, USERS, make_batches, reference, trainer_for
from workers.ps_servers import Servers, free_port

from jaxpar.ps.wire import encode

def _deep_rid(depth: int, token: str) -> bytes:
    """A request header whose ``rid`` is an array nested ``depth`` deep."""
    return ('{"op": "ping", "token": "%s", "arrays": [], "rid": %s%s}' % (token, "[" * depth, "]" * depth)).encode()


def _rid_depth_limit() -> int:
    """The deepest ``rid`` nesting ``json.loads`` parses on this interpreter (found by probing:
    it depends on the Python version and on the stack depth of the caller)."""
    lo, hi = 1, 40_000  # parses at lo, not at hi (a 64 KiB header cannot nest deeper)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            json.loads(_deep_rid(mid, "t"))
            lo = mid
        except RecursionError:
            hi = mid
    return lo


@pytest.fixture
def servers(tmp_path, tag):
    s = Servers(tmp_path, tag, count=2, token=TOKEN)
    yield s
    s.stop()


def test_sync_two_servers_equals_in_process_table(servers):
    batches = make_batches(20)
    want_losses, want = reference(20)
    client = ps.connect([USERS, ITEMS], addresses=servers.addresses, token=TOKEN, timeout=30,
                        worker=0, workers=1)
    source, trainer = trainer_for(client)
    got_losses = [h["loss"] for h in trainer.fit(source.prefetching(batches, 20), 20, progress=False)]
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


def test_trainer_with_server_rows_equals_in_process_table(servers):
    """The servers' tables as the row source of jaxpar.Trainer, on 8 devices with ZeRO-1 and
    grad_accum=2, each step's rows prefetched while the step before runs: the same losses and
    tables as the in-process reference on one device."""
    steps = 8
    want_losses, want = reference(steps)
    client = ps.connect([USERS, ITEMS], addresses=servers.addresses, token=TOKEN, timeout=30, worker=0, workers=1)
    source, trainer = trainer_for(client, jaxpar.ParallelConfig(
        mesh={"data": 8}, optimizer={"level": 1, "threshold_kb": 0}, grad_accum=2))
    history = trainer.fit(source.prefetching(make_batches(steps + 2), steps), steps, progress=False)
    got_losses = [h["loss"] for h in history]
    assert source.timings["prefetched"] == steps
    np.testing.assert_allclose(got_losses, want_losses, rtol=0, atol=1e-5)
    rows = client.pull_many({"users": np.arange(USERS.rows), "items": np.arange(ITEMS.rows)}, step=steps)
    np.testing.assert_allclose(rows["users"], want["users"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(rows["items"], want["items"], rtol=0, atol=1e-5)
    assert np.abs(rows["items"] - ps.init_rows(ITEMS, np.arange(ITEMS.rows))).max() > 1e-3  # it trained
    for g, w in zip(jax.tree.leaves(nnx.state(trainer.model)), jax.tree.leaves(want["tower"])):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    client.close()


def test_trainer_checkpoints_take_the_servers_along(servers, tmp_path):
    """Trainer(checkpoint_dir=...) with ServerRows: the servers snapshot at each checkpoint; a
    worker restarted after 6 steps (another init) resumes the checkpoint of step 4, the servers
    go back to step 4, and training goes on equal to the uninterrupted reference."""
    batches = make_batches(8)
    want_losses, want = reference(8)

    def trainer(seed):
        client = ps.connect([USERS, ITEMS], addresses=servers.addresses, token=TOKEN, timeout=30, worker=0,
                            workers=1)
        return client, trainer_for(client, seed=seed, checkpoint_dir=str(tmp_path / "ckpt"), save_every=4)[1]

    client, first = trainer(0)
    losses = [float(first.step(b)["loss"]) for b in batches[:6]]   # steps 5 and 6: lost with the worker
    first.close()
    client.close()
    client, second = trainer(1)
    assert second.step_count == 4
    losses = losses[:4] + [float(second.step(b)["loss"]) for b in batches[4:]]
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-5)
    rows = client.pull_many({"users": np.arange(USERS.rows), "items": np.arange(ITEMS.rows)}, step=8)
    np.testing.assert_allclose(rows["items"], want["items"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(rows["users"], want["users"], rtol=0, atol=1e-5)
    second.close()
    client.close()


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
    with pytest.raises(ValueError, match=r"table 'users': gradients of shape \[1, 3\] for ids of shape \[1\]; "
                                         r"expected \[1, 8\]$"):
        client.push("users", np.array([1]), np.zeros((1, 3)), step=0)
    with pytest.raises(TypeError, match=r"table 'users': gradients of dtype <U1; give numbers"):
        client.push("users", np.array([1]), np.full((1, 8), "a"), step=0)
    for call, bad in ((lambda s: client.pull("users", np.array([1]), step=s), "pull_many: step="),
                      (lambda s: client.push("users", np.array([1]), np.zeros((1, 8)), step=s), "push_many: step="),
                      (lambda s: client.push("users", np.array([1]), np.zeros((1, 8)), 0, pulled_at=s),
                       "push_many: pulled_at="), (client.save, "save: step="), (client.restore, "restore: step=")):
        for step in ("1", 0.5, -1, True):   # refused here, before a server parses it as it can
            with pytest.raises(ValueError, match=f"{bad}.* must be a worker step, an int >= 0"):
                call(step)
    # ids of any shape: rows of that shape (a [2, 2] gather read four rows into a [2, dim] array)
    ids = np.array([[3, 1999], [3, 7]])
    rows = client.pull("users", ids, step=np.int64(0))
    assert rows.shape == (2, 2, 8) and np.array_equal(rows[1, 0], client.pull("users", np.array(3), step=0))
    np.testing.assert_array_equal(rows.reshape(4, 8), client.pull("users", ids.reshape(-1), step=0))
    before = client.stats()["worker"]
    client.push("users", ids, np.zeros((2, 2, 8)), step=0)        # counted as rows, as pulls are: four
    after = client.stats()["worker"]
    assert (after["rows_pushed"] - before["rows_pushed"], after["pushes"] - before["pushes"]) == (4, 1)
    for address in ("localhost", "127.0.0.1:", "127.0.0.1:99999", 5555):
        with pytest.raises(ValueError, match="is not HOST:PORT with a port in 1..65535"):
            ps.connect([USERS], addresses=[address], token=TOKEN, timeout=5, worker=0, workers=1)
    with pytest.raises(ValueError, match=r"timeout='5' must be a positive finite number of seconds"):
        ps.connect([USERS], addresses=servers.addresses, token=TOKEN, timeout="5", worker=0, workers=1)
    client.close()
    start = time.monotonic()
    with pytest.raises(PermissionError, match="wrong job token") as e:
        ps.connect([USERS], addresses=servers.addresses, token="not-the-token", timeout=5, worker=0, workers=1)
    assert TOKEN not in str(e.value) and "not-the-token" not in str(e.value)
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=rf"parameter server {dead} did not answer 'hello' .*timeout=1.0 s"):
        ps.connect([USERS], addresses=[dead], token=TOKEN, timeout=1.0, worker=0, workers=1)
    assert time.monotonic() - start < 5
    # Raw messages that break the wire format get an error reply; nothing is unpickled.
    import pickle
    import zmq

    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{servers.addresses[0]}")
    bad_dtype = b'{"op": "pull", "token": "%s", "arrays": [{"dtype": "object", "shape": [1]}]}' % TOKEN.encode()
    for frames in ([pickle.dumps({"op": "pull"})], [bad_dtype, pickle.dumps([1])],
                   [b'{"op": "pull", "arrays": [{"dtype": "int64", "shape": [2]}]}', b"123"],
                   [b"[" * 50_000],                                    # nesting that would recurse
                   [b"[" * 70_000],                                    # a header over the limit
                   [b'{"arrays": [{"dtype": "float32", "shape": [4294967296, 4294967296, 4294967296]}]}', b""]):
        raw.send_multipart(frames)
        assert raw.poll(5000), "the server must answer a malformed message"
        header = json.loads(raw.recv_multipart()[0])
        assert header["ok"] is False and "malformed message" in header["error"]
    # a well-formed request with a value no handler expects gets an error reply, and the server lives on
    raw.send_multipart([b'{"op": "pull", "table": "users", "step": 1e999, "worker": 0, "token": "%s", '
                        b'"arrays": [{"dtype": "int64", "shape": [1]}]}' % TOKEN.encode(), np.zeros(1, np.int64).tobytes()])
    assert raw.poll(5000) and json.loads(raw.recv_multipart()[0])["ok"] is False
    # a rid nested just under the parser's limit, with a wrong token and with the right one: the
    # reply echoes no rid (echoing it made json.dumps raise RecursionError and the server exit)
    limit = _rid_depth_limit()
    for depth in range(limit - 30, limit + 4, 3):
        for token in ("wrong", TOKEN):
            raw.send_multipart([_deep_rid(depth, token)])
            assert raw.poll(5000), f"the server must answer, and outlive, a rid nested {depth} deep"
            header = json.loads(raw.recv_multipart()[0])
            assert header["rid"] is None and (header["ok"] or "malformed message" in header["error"]
                                              or "wrong job token" in header["error"])
    raw.send_multipart(encode({"op": "ping", "token": TOKEN, "rid": "still-there"}))
    assert raw.poll(5000) and json.loads(raw.recv_multipart()[0]) == {"rid": "still-there", "ok": True, "arrays": []}
    ctx.destroy(linger=0)
    other = ps.TableSpec("users", 999, DIM, ps.SGD(0.5))
    with pytest.raises(ValueError, match="table 'users' exists here as"):
        ps.connect([other], addresses=servers.addresses, token=TOKEN, timeout=5, worker=0, workers=1)
    with pytest.raises(ValueError, match="staleness=2 with mode='sync'"):
        ps.connect([USERS], addresses=servers.addresses, token=TOKEN, staleness=2)


def test_async_staleness_bound_is_enforced(servers):
    """τ = 1, two workers: a pull waits for the slow worker; a push from rows too old is refused."""
    kw = dict(mode="async", staleness=1, addresses=servers.addresses, token=TOKEN, timeout=20, workers=2)
    fast, slow = ps.connect([USERS], worker=0, **kw), ps.connect([USERS], worker=1, **kw)
    ids, grads = np.array([3, 4, 1000]), np.ones((3, DIM), np.float32)
    for step in (0, 1):  # the fast worker runs ahead by τ + 1 steps
        fast.pull("users", ids, step)
        fast.push("users", ids, grads, step)
    got = {}
    blocked = threading.Thread(target=lambda: got.update(rows=fast.pull("users", ids, 2)))
    blocked.start()
    blocked.join(1.0)
    assert blocked.is_alive(), "a pull at step 2 must wait for the updates of step 0 from every worker"
    before = slow.pull("users", ids, 0)
    slow.push("users", ids, grads, 0)  # the clock reaches 1: the fast worker's pull is served
    blocked.join(10)
    assert not blocked.is_alive() and "rows" in got
    slow.push("users", ids, grads, 1, pulled_at=0)  # rows 1 step old: allowed
    after_ok = slow.pull("users", ids, 2)
    slow.push("users", ids, grads, 2, pulled_at=0)  # rows 2 steps old: rejected, not applied
    assert np.array_equal(slow.pull("users", ids, 3), after_ok)
    assert not np.array_equal(before, after_ok)
    stats = slow.stats()
    assert stats["worker"]["rejected"] == 1
    assert stats["worker"]["staleness"] == {0: 1, 1: 1, 2: 1}  # one count per push of this worker
    table = stats["tables"]["users"]
    # ids 3, 4 live on server 0 and id 1000 on server 1 (range partition): a push counts on both;
    # the fast worker read its step-1 rows at clock 0, so its step-1 push was 1 step stale too.
    assert table["rejected"] == 2 and table["staleness_histogram"] == {0: 4, 1: 4, 2: 2}
    # The slow worker is killed in its step 3 (nothing of it pushed) and restarted: it rejoins at
    # step 3, and the fast worker, held back by the bound, goes on once it does.
    slow.close()
    assert fast.next_step() == 2
    fast.push("users", ids, grads, 2, pulled_at=2)
    fast.push("users", ids, grads, 3, pulled_at=2)
    blocked = threading.Thread(target=lambda: got.update(rows=fast.pull("users", ids, 5)))
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive()  # step 5 needs every worker's step 3 (clock >= 4)
    rejoined = ps.connect([USERS], worker=1, **kw)
    assert rejoined.next_step() == 3 and rejoined.stats()["tables"]["users"]["clock"] == 3
    rejoined.pull("users", ids, 3)
    rejoined.push("users", ids, grads, 3)
    blocked.join(10)
    assert not blocked.is_alive()
    # A fresh client of worker 0 says its step-4 rows come from a pull of step 1: the servers
    # served worker 0's pull of step 1 at clock 0, so the push is 4 steps stale and refused.
    fresh = ps.connect([USERS], worker=0, **kw)
    before = rejoined.pull("users", ids, 4)
    fresh.push("users", ids, grads, 4, pulled_at=1)
    assert np.array_equal(rejoined.pull("users", ids, 4), before)
    assert fresh.stats()["worker"]["rejected"] == 1 and fresh.stats()["worker"]["staleness"] == {4: 1}
    with pytest.raises(ValueError, match=r"worker 0 pushes step 5 from rows pulled at step 3, but server "
                                         r"127.0.0.1:\d+: .*|table 'users': worker 0 pushes step 5 from rows "
                                         r"pulled at step 3, but server \d of 2 served worker 0 no pull of step 3"):
        fresh.push("users", ids, grads, 5, pulled_at=3)  # worker 0 never pulled step 3
    fast.close(), rejoined.close(), fresh.close()


def test_server_logs_only_valid_pushes_and_replays_a_log_cut_by_a_kill(tmp_path):
    """In-process server state: bad pushes refused before the log; a torn last record ignored."""
    from jaxpar.ps.server import Server

    spec = ps.TableSpec("t", 10, 2, ps.SGD(1.0))
    server = Server(0, 2, str(tmp_path), every=100)
    server.handle({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1, "tables": [spec.to_json()]}, [])

    def push(ids, step=0):
        ids = np.array(ids)
        return server.handle({"op": "push", "table": "t", "step": step, "worker": 0},
                             [ids, np.ones((len(ids), 2), np.float32)])

    with pytest.raises(ValueError, match="table 't': id 1 belongs to another server than 0 of 2"):
        push([1])  # hash partition: odd ids live on server 1
    with pytest.raises(ValueError, match=r"table 't': id 12 outside \[0, 10\)"):
        push([12])
    assert push([0, 2, 2]) == ({"status": "applied", "staleness": 0}, ())
    assert push([0, 2, 2]) == ({"status": "duplicate"}, ())  # a resent push is not applied twice
    server.wal.file.write(b"\x02\x00\x00\x00\x10\x00")  # a record the kill cut short
    server.wal.file.flush()
    again = Server(0, 2, str(tmp_path), every=100)  # "restarted with the same arguments"
    assert again.restarts == 1 and again.tables["t"].clock == 1
    want = ps.init_rows(spec, np.array([0, 2])) - np.array([[1, 1], [2, 2]], np.float32)
    np.testing.assert_array_equal(again.tables["t"].weights[:2], want)
    assert again.handle({"op": "pull", "table": "t", "step": 2, "worker": 0}, [np.array([0])]) is None
    assert again.handle({"op": "pull", "table": "t", "step": 1, "worker": 0}, [np.array([0])])[0] == {"clock": 1}
    # the torn bytes were cut off the log: a push acknowledged after the restart survives the next one
    assert again.handle({"op": "push", "table": "t", "step": 1, "worker": 0},
                        [np.array([4]), np.ones((1, 2), np.float32)]) == ({"status": "applied", "staleness": 0}, ())
    assert Server(0, 2, str(tmp_path), every=100).tables["t"].clock == 2


def test_server_survives_any_frame_and_echoes_only_short_rids(tmp_path):
    """In-process: every frame gets one reply that echoes a rid only when it is a short string or
    an integer, whatever the nesting (around the parser's limit), the token or the reply."""
    from jaxpar.ps.server import Server, receive

    server = Server(0, 1, str(tmp_path))
    sent = []
    sock = type("Sock", (), {"send_multipart": lambda self, frames: sent.append(frames)})()

    def reply(frames):
        assert receive(server, sock, b"peer", frames, [], token=TOKEN, bind="here:1") == []
        assert len(sent) == 1 and sent[0][0] == b"peer"
        return json.loads(sent.pop()[1])

    limit = _rid_depth_limit()
    for depth in range(limit - 40, limit + 3):
        wrong, right = reply([_deep_rid(depth, "wrong")]), reply([_deep_rid(depth, TOKEN)])
        assert wrong["rid"] is None and right["rid"] is None
        if "malformed message" in wrong["error"]:  # over the parser's limit at this stack depth
            assert depth > limit - 20 and not right["ok"] and "malformed message" in right["error"]
        else:
            assert "wrong job token: server here:1 refused" in wrong["error"] and right["ok"] is True
    for rid, echo in (("0-7", "0-7"), (12, 12), ("x" * 128, "x" * 128), ("x" * 129, None), (True, None),
                      (1 << 64, None), ({"a": 1}, None), ([1], None)):
        assert reply(encode({"op": "ping", "token": TOKEN, "rid": rid}))["rid"] == echo
    # a value no message may quote in full: an operation nested 900 deep, a 60 KiB table name
    bad = reply(encode({"op": "pull", "token": TOKEN, "rid": "r", "table": "t" * 60_000, "step": 0}))
    assert bad["error"] == f"unknown table '{'t' * 59}... (60002 characters); this server holds []"
    bad = reply([b'{"op": %s, "token": "%s", "arrays": []}' % (b"[" * 900 + b"]" * 900, TOKEN.encode())])
    assert bad["error"] == "unknown operation <a JSON array of 1 item>"
    bad = reply(encode({"op": "hello", "token": TOKEN, "rid": "h", "mode": [["sync"]], "staleness": 0,
                        "workers": 1, "tables": []}))
    assert bad["error"].startswith("hello: mode=<a JSON array of 1 item>, staleness=0, workers=1; expected")
    assert server.job is None  # a refused hello leaves no job behind for the checkpoints to choke on
    assert reply(encode({"op": "ping", "token": TOKEN, "rid": "after"})) == {"rid": "after", "ok": True, "arrays": []}


def test_async_staleness_is_measured_from_the_pull_the_server_served(tmp_path):
    """The server, not the client, knows when it served a worker's pull: a forged read clock is
    ignored, a pull never served is refused, and a restart keeps (or bounds) what it knew."""
    from jaxpar.ps.server import Server

    spec = ps.TableSpec("t", 4, 2, ps.SGD(1.0))
    server = Server(0, 1, str(tmp_path), every=4)
    server.handle({"op": "hello", "mode": "async", "staleness": 1, "workers": 1, "tables": [spec.to_json()]}, [])

    def pull(srv, step):
        return srv.handle({"op": "pull", "table": "t", "step": step, "worker": 0}, [np.array([0])])

    def push(srv, step, **fields):
        return srv.handle({"op": "push", "table": "t", "step": step, "worker": 0, **fields},
                          [np.array([0]), np.ones((1, 2), np.float32)])[0]

    for step in range(6):  # a checkpoint at clock 4 records the pulls of steps 0 .. 3
        pull(server, step)
        assert push(server, step) == {"status": "applied", "staleness": 0}
    # a fresh client at step 6 claims rows pulled at step 1 and a read clock of 6: the pull of
    # step 1 was served at clock 1, so the push is 5 steps stale
    assert push(server, 6, pulled_at=1, read_clock=6) == {"status": "rejected", "staleness": 5}
    with pytest.raises(ValueError, match=r"table 't': worker 0 pushes step 7 from rows pulled at step 6, but "
                                         r"server 0 of 1 served worker 0 no pull of step 6 \(its recorded "
                                         r"pulls: steps 0 .. 5; it keeps the last 64 steps\)"):
        push(server, 7, pulled_at=6)
    pull(server, 7)
    again = Server(0, 1, str(tmp_path), every=4)  # restarted: the log replays the same decisions
    np.testing.assert_array_equal(again.tables["t"].weights, server.tables["t"].weights)
    assert again.tables["t"].stats() == server.tables["t"].stats()
    # the pull of step 2 came back with the checkpoint; that of step 7 (after it) is measured from
    # the checkpoint's clock 4, the oldest clock it can have been served at
    assert push(again, 7) == {"status": "rejected", "staleness": 3}
    assert push(again, 8, pulled_at=2) == {"status": "rejected", "staleness": 6}
    with pytest.raises(ValueError, match="no pull of step 9"):  # not servable before the kill (clock 7, τ 1)
        push(again, 9, pulled_at=9)
    pull(again, 9)
    assert push(again, 9) == {"status": "applied", "staleness": 0}
    # restarted again (from a checkpoint at clock 8): the pull of step 7, lost in the first
    # restart, is still measured from clock 4
    third = Server(0, 1, str(tmp_path), every=4)
    assert push(third, 10, pulled_at=7) == {"status": "rejected", "staleness": 6}


def test_lazy_adam_rows_and_partition_independent_init():
    """Lazy Adam equals optax.adam on rows that get a gradient at every step, and leaves the
    others alone; a table's shards over any server count and partition join to one table."""
    from jaxpar.ps.shard import TableShard

    spec = ps.TableSpec("t", 6, 3, ps.Adam(0.01), seed=5)
    shard = TableShard(spec, 0, 1, "sync", 0, 1)
    full = jax.numpy.asarray(ps.init_rows(spec, np.arange(6)))
    tx = optax.adam(0.01, b1=0.9, b2=0.999, eps=1e-8)
    opt = tx.init(full[:4])
    rng = np.random.default_rng(0)
    for step in range(5):
        g = rng.normal(size=(4, 3)).astype(np.float32)
        shard.push(step, 0, step, np.arange(4), g)  # rows 4 and 5 never get a gradient
        updates, opt = tx.update(jax.numpy.asarray(g), opt, full[:4])
        full = full.at[:4].set(optax.apply_updates(full[:4], updates))
    np.testing.assert_allclose(shard.weights, full, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(shard.weights[4:], ps.init_rows(spec, np.array([4, 5])))
    for partition in ("hash", "range"):
        for count in (1, 3, 4):
            s = ps.TableSpec("t", 10, 4, ps.SGD(1.0), partition=partition, seed=7)
            table = np.zeros((10, 4), np.float32)
            for i in range(count):
                table[s.shard_ids(i, count)] = TableShard(s, i, count, "sync", 0, 1).weights
            np.testing.assert_array_equal(table, ps.init_rows(s, np.arange(10)))


class _Client:
    """What ServerRows asks of a client before any pull: its tables, the worker count, the next step."""

    tables, workers = {"users": USERS, "items": ITEMS}, 1

    def next_step(self):
        return 3


def test_server_rows_refuse_unknown_tables_and_misaligned_saves():
    with pytest.raises(ValueError, match=r"fields read tables \['ads'\] the client does not know"):
        ps.ServerRows(_Client(), {"ad": "ads"})
    source = ps.ServerRows(_Client(), FIELDS)
    assert source.step == 3       # a worker rejoins where the servers expect it
    with pytest.raises(ValueError, match="the Trainer saves step 0 but the servers are at step 3"):
        source.save(0)


def test_a_non_finite_step_pushes_an_empty_set_that_the_servers_count():
    """ServerRows.push(handle, None, step) (the Trainer's word for a non-finite step): every table
    of the pull gets an empty push at the pull's step, so sync servers count the step and a lazy
    optimizer on the servers moves no row."""
    from jaxpar.ps.tables import TableSpec
    from jaxpar.ps.worker import ServerRows

    class Client:
        tables = {"users": TableSpec("users", 10, 4, ps.SGD(0.1)), "items": TableSpec("items", 20, 3, ps.SGD(0.1))}
        workers, pushed = 2, []

        def next_step(self):
            return 5

        def pull_many(self, unique, step):
            return {t: np.ones((len(u), self.tables[t].dim), np.float32) for t, u in unique.items()}

        def push_many(self, grads, step):
            self.pushed.append((step, {t: (ids.tolist(), g.shape) for t, (ids, g) in grads.items()}))

    client = Client()
    source = ServerRows(client, {"user": "users", "item": "items"})
    batch = {"user": np.array([[1], [3]]), "item": np.array([[2], [2]]), "label": np.zeros(2)}
    _, rows, handle = source.pull(batch)
    source.push(handle, None, 6)
    assert client.pushed == [(5, {"users": ([], (0, 4)), "items": ([], (0, 3))})]
    assert source.step == 6
    source.push(source.pull(batch)[2], {t: np.ones_like(r) for t, r in rows.items()}, 7)
    assert client.pushed[1][0] == 6 and client.pushed[1][1] == {"users": ([1, 3], (2, 4)), "items": ([2], (1, 3))}


def test_a_restart_gives_each_table_its_own_pending_sync_pushes(tmp_path):
    """A checkpoint taken while sync pushes wait for the other workers (SIGTERM, a snapshot):
    each table gets back its own, also when another table's name is as long."""
    from jaxpar.ps.server import Server

    specs = [ps.TableSpec("aa", 10, 2, ps.SGD(1.0)), ps.TableSpec("bb", 10, 2, ps.SGD(1.0))]
    server = Server(0, 1, str(tmp_path), every=100)
    server.handle({"op": "hello", "mode": "sync", "staleness": 0, "workers": 2,
                   "tables": [s.to_json() for s in specs]}, [])
    for name, ids in (("aa", [1]), ("bb", [5, 6])):
        server.handle({"op": "push", "table": name, "step": 0, "worker": 0},
                      [np.array(ids), np.ones((len(ids), 2), np.float32)])
    server.checkpoint()  # what SIGTERM does
    again = Server(0, 1, str(tmp_path), every=100)
    assert again.tables["aa"].pending[0][0][0].tolist() == [1]
    assert again.tables["bb"].pending[0][0][0].tolist() == [5, 6]
    for name, ids in (("aa", [1]), ("bb", [5])):  # worker 1's pushes complete step 0
        assert again.handle({"op": "push", "table": name, "step": 0, "worker": 1},
                            [np.array(ids), np.ones((1, 2), np.float32)])[0]["status"] == "applied"
    np.testing.assert_allclose(again.tables["aa"].weights[1], ps.init_rows(specs[0], np.array([1]))[0] - 2)


def test_server_rows_push_every_table_of_the_client_and_name_missing_fields():
    """A table of the client that no field reads still gets an empty push each step: otherwise
    its clock stayed 0, so the servers' snapshot (ServerRows.save) waited for it until the
    client's timeout and next_step() put a restarted worker back at step 0."""
    from jaxpar.ps.tables import TableSpec
    from jaxpar.ps.worker import ServerRows

    class Client:
        tables = {"users": TableSpec("users", 10, 4, ps.SGD(0.1)), "spare": TableSpec("spare", 20, 3, ps.SGD(0.1))}
        workers, pushed = 1, []

        def next_step(self):
            return 0

        def pull_many(self, unique, step):
            return {t: np.ones((len(u), self.tables[t].dim), np.float32) for t, u in unique.items()}

        def push_many(self, grads, step):
            self.pushed.append((step, {t: (ids.tolist(), g.shape) for t, (ids, g) in grads.items()}))

    client = Client()
    source = ServerRows(client, {"user": "users"})
    _, rows, handle = source.pull({"user": np.array([1, 3, 1]), "label": np.zeros(3)})
    source.push(handle, {"users": np.ones_like(rows["users"])}, 1)
    source.push(source.pull({"user": np.array([2])})[2], None, 2)
    assert client.pushed == [(0, {"users": ([1, 3], (2, 4)), "spare": ([], (0, 3))}),
                             (1, {"users": ([], (0, 4)), "spare": ([], (0, 3))})]
    with pytest.raises(ValueError, match=r"the batch has no ids for fields \['user'\] \(tables \['users'\]\); "
                                         r"its keys: \['item', 'label'\]"):
        source.pull({"item": np.array([1]), "label": np.zeros(1)})


@pytest.mark.parametrize("make, words", [
    (lambda: ps.TableSpec("z", 10, 4, ps.SGD(1.0), seed=-1), r"TableSpec 'z': seed=-1 must be an int in \[0, 2\*\*64\)"),
    (lambda: ps.TableSpec("z", 10, 4, ps.SGD(1.0), init_scale="x"), r"TableSpec 'z': init_scale='x' must be a finite"),
    (lambda: ps.TableSpec("z", 10, 4, ps.SGD(1.0), init_scale=float("nan")), r"init_scale=nan must be a finite"),
    (lambda: ps.SGD(float("inf")), r"SGD: lr=inf must be a positive finite number"),
    (lambda: ps.SGD(True), r"SGD: lr=True must be a positive finite number"),
    (lambda: ps.Adagrad(0.1, initial_accumulator="x"), r"Adagrad: initial_accumulator='x' must be a finite number"),
    (lambda: ps.Adam(0.1, eps=-1), r"Adam: eps=-1 must be a finite number >= 0"),
    (lambda: ps.Adam(0.1, b1="x"), r"Adam: b1='x' must be in \[0, 1\)"),
    (lambda: ps.RowOptimizer(learning_rate="x"), r"RowOptimizer learning_rate='x' must be a finite number"),
    (lambda: ps.RowOptimizer(kind="adagrad", eps=float("inf")), r"RowOptimizer eps=inf must be a finite number"),
])
def test_table_specs_and_row_optimizers_refuse_bad_numbers_by_name(make, words):
    """Refused where they are made, naming the field: a negative seed raised OverflowError from
    init_rows (on the server, at hello), a string init_scale or Adagrad accumulator a bare
    comparison TypeError, an infinite rate or a negative Adam eps trained NaN rows."""
    with pytest.raises(ValueError, match=words):
        make()


def test_table_spec_numbers_of_numpy_types_go_to_the_servers_as_json():
    spec = ps.TableSpec("z", 10, 4, ps.Adam(np.float32(0.5)), seed=np.int64(2), init_scale=np.float32(0.25))
    assert ps.TableSpec.from_json(json.loads(json.dumps(spec.to_json()))).optimizer == ps.Adam(0.5)


def test_a_snapshot_of_an_abandoned_history_is_written_again(tmp_path):
    """Saved at step 4, back to step 2, steps 2-3 trained otherwise, saved at 4 again: a restore
    of step 4 gives the new history's rows (the old snapshot was kept, so a checkpoint of step 4
    written after the restore, e.g. where the first one was left incomplete, got the old rows)."""
    from jaxpar.ps.server import Server

    spec = ps.TableSpec("t", 4, 2, ps.SGD(1.0))
    server = Server(0, 1, str(tmp_path), every=100)
    server.handle({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1, "tables": [spec.to_json()]}, [])

    def push(step, g):
        server.handle({"op": "push", "table": "t", "step": step, "worker": 0},
                      [np.array([0]), np.full((1, 2), g, np.float32)])

    push(0, 1.0), push(1, 1.0), server.handle({"op": "save", "step": 2}, [])
    push(2, 1.0), push(3, 1.0), server.handle({"op": "save", "step": 4}, [])
    server.handle({"op": "restore", "step": 2}, [])
    push(2, 5.0), push(3, 5.0), server.handle({"op": "save", "step": 4}, [])
    server.handle({"op": "save", "step": 4}, [])                   # another worker's request: kept
    new = server.tables["t"].weights[0].copy()
    np.testing.assert_allclose(new, ps.init_rows(spec, np.array([0]))[0] - 12, rtol=1e-6)
    push(4, 1.0)
    restarted = Server(0, 1, str(tmp_path), every=100)              # a restart keeps what it knew
    restarted.handle({"op": "restore", "step": 4}, [])
    np.testing.assert_array_equal(restarted.tables["t"].weights[0], new)
    restarted.handle({"op": "restore", "step": 2}, [])
    np.testing.assert_allclose(restarted.tables["t"].weights[0], ps.init_rows(spec, np.array([0]))[0] - 2, rtol=1e-6)


def test_a_damaged_log_record_is_named_and_the_server_exits_2(tmp_path):
    """A whole log record that does not decode (a disk error; not a kill's cut, which ends the
    replay) stops the start with one line naming the file and the record, not a traceback."""
    import os
    import subprocess
    import sys

    from jaxpar.ps.server import Server
    from jaxpar.ps.store import StoreError

    spec = ps.TableSpec("t", 4, 2, ps.SGD(1.0))
    server = Server(0, 1, str(tmp_path), every=100)
    server.handle({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1, "tables": [spec.to_json()]}, [])
    for step in range(2):
        server.handle({"op": "push", "table": "t", "step": step, "worker": 0}, [np.array([0]), np.ones((1, 2), np.float32)])
    server.wal.close()
    wal = tmp_path / "server-0-of-1" / "wal.bin"
    data = bytearray(wal.read_bytes())
    data[20] ^= 0xFF                                   # inside the first record's header
    wal.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"wal.bin': record 0 at byte 16 is damaged \(its header's checksum"):
        Server(0, 1, str(tmp_path), every=100)
    env = {**os.environ, "JAXPAR_PS_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "jaxpar.ps.server", "--index", "0", "--count", "1",
                          "--checkpoint-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr and "record 0 at byte 16 is damaged" in run.stderr


def test_server_rows_refuses_process_layouts_its_blocks_do_not_follow():
    """Several processes: process p's rows are block p of the rows array over batch_axis, so a
    mesh whose devices are not in process order along that axis is refused by name (it used to
    place rows where another process's indices pointed, or divide by zero)."""
    from jaxpar.ps.worker import check_process_blocks

    check_process_blocks(np.arange(8).reshape(8, 1) // 2, ("data", "model"), "data", 4)        # 4 x 2, in order
    check_process_blocks(np.array([[0, 0, 1, 1], [0, 0, 1, 1]]), ("model", "data"), "data", 2)
    grid = np.array([[0, 0, 1, 1], [2, 2, 3, 3]])      # {"model": 2, "data": 4}, 4 processes of 2 devices
    with pytest.raises(ValueError, match=r"position 0 of 'data' is driven by process\(es\) \[0, 2\], but process 0's"):
        check_process_blocks(grid, ("model", "data"), "data", 4)
    with pytest.raises(ValueError, match=r"mesh \{'model': 2, 'data': 4\}, batch_axis='model' has 2 positions, "
                                         r"not a multiple of the 4 processes"):
        check_process_blocks(grid, ("model", "data"), "model", 4)
    with pytest.raises(ValueError, match=r"batch_axis='batch' is not an axis of the mesh \('model', 'data'\)"):
        check_process_blocks(grid, ("model", "data"), "batch", 4)
    with pytest.raises(ValueError, match=r"position 1 of 'data' is driven by process\(es\) \[1\], but process 0's"):
        check_process_blocks(np.array([[0, 1, 0, 1]]), ("model", "data"), "data", 2)
