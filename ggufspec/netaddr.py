"""Addresses: whether a host is this machine alone (the server and RPC workers warn beyond it)."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only: "localhost", 127.0.0.0/8 or ::1, in any spelling the
    system's resolver takes for one of them ("LOCALHOST", "127.1", "0x7f000001"). A name other than
    localhost is not resolved: it counts as beyond this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host != host.strip() or " " in host:  # inet_aton reads "127.0.0.1 evil.com" as its first word
        return False
    try:  # the shortened and numeric IPv4 forms (inet_aton's), which bind where they seem to
        return ipaddress.IPv4Address(socket.inet_aton(host)).is_loopback
    except (OSError, ValueError):
        return False
