"""Addresses: whether a host is this machine alone (the server and RPC workers warn beyond it)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only: "localhost", 127.0.0.0/8 or ::1 (a name other than
    localhost is not resolved: it counts as beyond this machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
