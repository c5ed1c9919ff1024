"""Host networking the runner's parts share."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now on `host` ("": every interface), the OS's pick: for
    torch.distributed rendezvous and local servers."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
