"""Is a TCP port free on this host? Used before process 0 starts the coordinator service."""

from __future__ import annotations

import errno
import ipaddress
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


BIND_ADDRESS = "JAXPAR_COORDINATOR_BIND_ADDRESS"
"""Where process 0's coordinator listens; ``jaxpar launch --bind-address`` sets it."""
_LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def _split_bind(address: str, port: int) -> tuple[str, int] | None:
    """``"host"``, ``"host:port"``, ``"[v6]"`` or ``"[v6]:port"`` → (host, port), else None."""
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return (host, int(rest[1:]) if rest else port) if host else None
    if text.count(":") > 1:  # a bare IPv6 address, no port
        return text, port
    host, sep, tail = text.partition(":")
    if sep and not tail.isdigit():
        return None
    return (host, int(tail) if sep else port) if host else None


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_bind_address(address: str, port: int, flag: str = BIND_ADDRESS) -> str:
    """``address`` as ``host:port`` (the port defaults to ``port``); ValueError if malformed.

    Example:
        >>> check_bind_address("10.0.0.1", 8118), check_bind_address("[::1]:9000", 8118)
        ('10.0.0.1:8118', '[::1]:9000')
    """
    parts = _split_bind(address, port) if isinstance(address, str) else None
    if parts is None or not 0 < parts[1] < 65536:
        given = f"{flag}{'' if flag.endswith('=') else ' '}{address!r}"
        raise ValueError(
            f"{given} must be an address of this host, with an optional port in "
            "1..65535: '127.0.0.1', '10.0.0.1:8118', '[::1]', or '0.0.0.0' to listen on all "
            "interfaces."
        )
    return _join(*parts)


def listen_problem(host: str) -> str | None:
    """``None`` when this host can listen on ``host`` (an IP or name of one of its interfaces, or
    ``0.0.0.0`` / ``::``), else why not. JAX's coordinator kills its process (SIGSEGV) when it cannot."""
    if host in ("0.0.0.0", "::"):
        return None
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        return f"does not resolve to an address ({getattr(err, 'strerror', None) or err})"
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.bind(address)
            return None
        except OSError:
            continue
    found = sorted({info[4][0] for info in infos})
    return f"is not an address of this host (it is {', '.join(found)})" if found != [host] else \
        "is not an address of this host"


def check_can_listen(bind: str, flag: str = BIND_ADDRESS) -> None:
    """ValueError naming ``flag`` when this host cannot listen on ``bind`` (``host:port``)."""
    host = bind.rpartition(":")[0].strip("[]")
    problem = listen_problem(host)
    if problem:
        given = f"{flag}{'' if flag.endswith('=') else ' '}{bind!r}"
        raise ValueError(f"{given}: {host} {problem}; process 0's coordinator cannot listen there. Give an IP of "
                         "this host's interface that the other processes reach (ip -brief address lists them), "
                         "or 0.0.0.0 for all interfaces.")


def is_loopback(host: str) -> bool:
    """True for ``localhost``, ``127.x.x.x`` and ``::1``."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_local_ip(host: str) -> bool:
    """True when ``host`` is an IP literal of one of this host's interfaces."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return False
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))  # binding fails for an address that is not ours
        return True
    except OSError:
        return False


def coordinator_bind_address(coordinator_address: str, requested: str | None,
                             flag: str = BIND_ADDRESS) -> str | None:
    """Where process 0's coordinator should listen; ``None`` means all interfaces.

    ``requested`` (``--bind-address`` / ``JAXPAR_COORDINATOR_BIND_ADDRESS``) wins. Otherwise
    the coordinator listens only on the interface of its own address when that is loopback or
    an IP of this host; for a host *name* (SLURM, Kubernetes) it cannot tell which interface
    the others reach, and JAX listens on all of them.

    Example:
        >>> coordinator_bind_address("127.0.0.1:8118", None)
        '127.0.0.1:8118'
        >>> coordinator_bind_address("node-0:8118", "0.0.0.0")
        '0.0.0.0:8118'
    """
    host, _, port_text = coordinator_address.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    if requested is not None and requested.strip():
        bind = check_bind_address(requested, port, flag)
        check_can_listen(bind, flag)
        return bind
    if is_loopback(host) or _is_local_ip(host):
        return _join(host, port)
    return None
