"""A free TCP port for a local multi-process job (two gloo ranks under torchrun, a test child, a recipe)."""

from __future__ import annotations

import random
import socket

from msprobe_core.errors import MsprobeError

PORT_RANGE = (20000, 32000)
"""Where ``free_port`` looks: below Linux's ephemeral range (32768-60999), which the kernel hands to every outgoing
connection (gloo opens many); a port taken from inside that range can be grabbed by one of them between the check
and the child's bind ("address already in use" under load)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``, outside the ephemeral range, chosen at random (jobs run in parallel:
    never a fixed one, and two of them rarely try the same)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise MsprobeError(f"no free TCP port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} on {host}")
