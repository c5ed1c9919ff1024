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
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise PortUnavailable(f"cannot listen on {host}:{port}: {err.strerror}") from None
