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


def _main(argv, monkeypatch, capsys):
    """The server's command line in this process: its exit code and what it wrote to stderr."""
    from jaxpar.ps import server

    def served(*args):   # (a value taken by mistake would serve until killed)
        raise AssertionError(f"the server started serving with {argv}")

    monkeypatch.setattr(server, "serve", served)
    monkeypatch.setenv("JAXPAR_PS_TOKEN", "t0ken")
    main = server.main
    with pytest.raises(SystemExit) as exit_:
        main(["--index", "0", "--count", "1", *argv])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--bind", "127.0.0.1:99999"], r"--bind '127.0.0.1:99999' is not HOST:PORT with a port in 0..65535 \(0: any "
                                    r"free port\); e.g. --bind 127.0.0.1:5555"),
    (["--bind", "127.0.0.1:-1"], r"--bind '127.0.0.1:-1' is not HOST:PORT with a port in 0..65535"),
    (["--bind", "5555"], r"--bind '5555' is not HOST:PORT"),
    (["--bind", "nohost:5555"], r"--bind 'nohost:5555': cannot listen there \(No such device\); 'nohost' is not "
                                r"an address of this machine: give one of its IP addresses, 127.0.0.1"),
    (["--checkpoint-every", "-5"], r"--checkpoint-every -5 must be an integer >= 1"),
    (["--checkpoint-every", "0"], r"--checkpoint-every 0 must be an integer >= 1"),
])
def test_the_server_command_line_refuses_bad_values_in_one_line(tmp_path, monkeypatch, capsys, argv, words):
    """--bind 127.0.0.1:99999 served on port 34463 (99999 - 65536), --checkpoint-every -5 was
    taken, and a host name that is not this machine's ended in ZeroMQ's traceback."""
    code, err = _main(["--checkpoint-dir", str(tmp_path), *argv], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert __import__("re").search(words, err), err
    assert not (tmp_path / "server-0-of-1").exists()   # refused before anything was written


def test_a_port_in_use_and_a_file_as_checkpoint_dir_are_named(tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _main(["--bind", f"127.0.0.1:{port}", "--checkpoint-dir", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and err == (f"python -m jaxpar.ps.server: error: --bind '127.0.0.1:{port}': cannot listen "
                                 f"there (Address already in use); port {port} is in use (another server still "
                                 "running?): stop that process, give another port, or port 0 for any free one\n")
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    code, err = _main(["--bind", "127.0.0.1:0", "--checkpoint-dir", str(afile)], monkeypatch, capsys)
    assert code == 2 and err == (f"python -m jaxpar.ps.server: error: --checkpoint-dir '{afile}' is a file, not a "
                                 "directory; give a directory (it is created if missing)\n")


def test_the_server_process_exits_2_without_a_traceback_on_a_bad_bind(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAXPAR_PS_TOKEN": "t0ken", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "jaxpar.ps.server", "--index", "0", "--count", "1", "--bind",
                          "nohost:5555", "--checkpoint-dir", str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.startswith("python -m jaxpar.ps.server: error: --bind 'nohost:5555'")
    assert "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("fields, arrays, words", [
    ({"op": "push", "table": "t", "worker": 0}, 2, "malformed 'push' request: field 'step' is missing; expected an "
                                                   "integer in [0, 2**31) (a worker step)"),
    ({"op": "push", "table": "t", "step": -1, "worker": 0}, 2, "malformed 'push' request: field 'step' is -1; "
                                                              "expected an integer in [0, 2**31) (a worker step)"),
    ({"op": "push", "table": "t", "step": "abc", "worker": 0}, 2, "field 'step' is 'abc'; expected an integer"),
    ({"op": "push", "table": "t", "step": 1.5, "worker": 0}, 2, "field 'step' is 1.5; expected an integer"),
    ({"op": "push", "table": "t", "step": 0}, 2, "field 'worker' is missing; expected an integer in [0, 2**31) "
                                                 "(a worker index)"),
    ({"op": "push", "table": "t", "step": 0, "worker": 0, "pulled_at": -2}, 2, "field 'pulled_at' is -2"),
    ({"op": "pull", "table": "t", "step": [1], "worker": 0}, 1, "malformed 'pull' request: field 'step' is [1]"),
    ({"op": "pull", "table": ["t"], "step": 0, "worker": 0}, 1, "unknown table ['t']; this server holds ['t']"),
    ({"op": "save"}, 0, "malformed 'save' request: field 'step' is missing"),
    ({"op": "restore", "step": None}, 0, "malformed 'restore' request: field 'step' is None"),
    ({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1}, 0,
     "hello: tables=None; expected a JSON array of table descriptions (TableSpec.to_json())"),
    ({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1, "tables": [{"name": "u"}]}, 0,
     "malformed 'hello' request: table 'u' lacks fields ['rows', 'dim', 'optimizer', 'partition', 'init_scale', "
     "'seed']"),
    ({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1, "tables": [{**SPEC.to_json(), "rows": "9"}]}, 0,
     "malformed 'hello' request: table 't': rows='9' must be integers >= 1"),
    ({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1,
      "tables": [{**SPEC.to_json(), "name": "u", "optimizer": {"kind": "SGD", "momentum": 1}}]}, 0,
     "malformed 'hello' request: table 'u': optimizer 'SGD' does not take the fields ['momentum']"),
])
def test_a_malformed_authenticated_request_gets_a_protocol_error_naming_the_field(tmp_path, fields, arrays, words):
    """Such requests got raw Python text ("'step'", "invalid literal for int() with base 10: 'abc'",
    "unhashable type: 'list'"), and a push at step -1 was acknowledged and logged."""
    import json

    from jaxpar.ps.server import Server, receive
    from jaxpar.ps.wire import encode

    server = Server(0, 1, str(tmp_path))
    server.handle({"op": "hello", "mode": "sync", "staleness": 0, "workers": 1, "tables": [SPEC.to_json()]}, [])
    sent = []
    sock = type("Sock", (), {"send_multipart": lambda self, frames: sent.append(frames)})()
    payload = (np.array([0]), np.ones((1, 4), np.float32))[:arrays]
    receive(server, sock, b"peer", encode({**fields, "token": "t0ken", "rid": 7}, payload), [], token="t0ken",
            bind="here:1")
    reply = json.loads(sent.pop()[1])
    assert reply["ok"] is False and reply["rid"] == 7 and words in reply["error"], reply["error"]
    assert server.wal.count == 0 and server.tables["t"].clock == 0     # nothing logged, nothing applied
    receive(server, sock, b"peer", encode({"op": "ping", "token": "t0ken", "rid": 8}), [], token="t0ken", bind="here:1")
    assert json.loads(sent.pop()[1])["ok"] is True
