"""Host networking the runner's parts share."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now on `host` ("": every interface), the OS's pick: for
    torch.distributed rendezvous and local servers."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PortUnavailable(RuntimeError):
    """A server cannot listen on host:port (another program listens there, or the host is not
    one of this machine's addresses)."""


def check_listenable(host: str, port: int) -> None:
    """Raises PortUnavailable unless a server could listen on host:port now. SO_REUSEADDR as
    servers set it: a port whose last connections are in TIME_WAIT is free, one that another
    socket listens on is not."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as err:  # gaierror too: a host name that does not resolve
        raise PortUnavailable(f"cannot listen on {host}:{port}: {err.strerror}") from None
