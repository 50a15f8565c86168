"""Is a TCP port free on this host? Used before process 0 starts the coordinator service."""

from __future__ import annotations

import errno
import socket


def port_problem(port: int) -> str | None:
    """``None`` when ``port`` can be bound on all addresses, else why not (``"is already in use"``).

    The coordinator binds ``[::]:port`` (all addresses); JAX crashes when that fails, so look
    first. ``SO_REUSEADDR`` as the server sets it, so a port in TIME_WAIT counts as free.
    """
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here: try IPv4
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind((host, port))
                return None
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return "is already in use on this host"
                if err.errno == errno.EACCES:
                    return "needs privileges to bind on this host"
    return "cannot be bound on this host"


def free_port() -> int:
    """A port that is free now (the kernel's pick), e.g. for ``--master-port`` in tests."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
