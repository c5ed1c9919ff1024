"""`check_listenable`: a port a server could listen on passes, whatever the address family; a
taken port, an address of another machine and a name that does not resolve are refused, each
saying why."""

from __future__ import annotations

import re
import socket

import pytest

from mtprun.runner.net import PortUnavailable, check_listenable, free_port


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


IPV6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")


@pytest.mark.parametrize(
    "host", ["127.0.0.1", pytest.param("::1", marks=IPV6), "localhost", "0.0.0.0", ""]
)
def test_a_free_port_passes(host):
    check_listenable(host, free_port())


@pytest.mark.parametrize(
    ("family", "host"),
    [(socket.AF_INET, "127.0.0.1"), pytest.param(socket.AF_INET6, "::1", marks=IPV6)],
)
def test_a_port_another_socket_listens_on_is_refused(family, host):
    with socket.socket(family) as taken:
        taken.bind((host, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            PortUnavailable,
            match=re.escape(f"cannot listen on {host}:{port}: Address already in use"),
        ):
            check_listenable(host, port)


def test_a_port_whose_connections_closed_is_free():
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: its end waits in TIME_WAIT
    check_listenable("127.0.0.1", port)


def test_a_name_that_does_not_resolve_is_refused():
    with pytest.raises(PortUnavailable, match=re.escape("cannot listen on no-such-host.invalid:")):
        check_listenable("no-such-host.invalid", free_port())
