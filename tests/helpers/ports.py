"""A port for a torch store that a test's processes start, held for them from the moment it is drawn.

Drawing a free port (binding port 0) and closing it, then handing the number to a process that binds it
later, races every other process on the machine: torchrun and a rank 0 bind it only after their imports,
seconds later, and another job or test may have taken it meanwhile (the launcher's own case:
``train.failures.port_taken``). :func:`held_port` keeps the drawn port bound instead, with ``SO_REUSEADDR``
and never listening, until its block ends. Linux then gives it to no other process: never to a plain bind
of it, and not to a bind of port 0 nor as an outgoing connection's source port while the ephemeral range
has another free port. torch's ``TCPStore`` server binds with ``SO_REUSEADDR`` too (libuv's and the
classic one alike), and while no socket listens on a port Linux lets every socket that asked for address
reuse bind it: the store binds the held port and listens. Connections reach its listening socket only.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A free port on 127.0.0.1, held (module docstring) while the block runs the processes given it."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]
