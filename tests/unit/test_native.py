"""hvdtrain's bind library, built with this machine's C compiler and preloaded for real."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys

import psutil
import pytest

from hvdtrain import native

BIND = """
import errno, json, os, socket, subprocess, sys
found = {}
for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    with socket.socket(family) as listener:
        try:
            listener.bind((wildcard, 0))
            found[wildcard] = listener.getsockname()[0].split("%")[0]
        except OSError as error:
            found[wildcard] = errno.errorcode[error.errno]
with socket.socket() as explicit:
    explicit.bind(("127.0.0.1", 0))
found["environ"] = [os.environ.get("LD_PRELOAD"), os.environ.get("HVDTRAIN_BIND_INTERFACE")]
child = [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD'))"]
found["child"] = subprocess.run(child, capture_output=True, text=True).stdout.strip()
print(json.dumps(found))
"""


def preloaded(library, interface: str, preload: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": preload, native.INTERFACE_VARIABLE: interface}
    completed = subprocess.run(
        [sys.executable, "-c", BIND], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(completed.stdout)


@pytest.fixture(scope="module")
def library():
    built, problem = native.bind_library()
    assert built is not None, problem
    assert native.bind_library() == (built, None), "built once, then found"
    return built


def _ipv6(interface: str) -> str:
    """The IPv6 address the library picks on interface (global before link-local), or what binding
    a wildcard IPv6 address gives where there is none (loopback; no IPv6 at all: EAFNOSUPPORT)."""
    found = [
        a.address.split("%")[0]
        for a in psutil.net_if_addrs().get(interface, [])
        if a.family == socket.AF_INET6
    ]
    found.sort(key=lambda address: ipaddress.IPv6Address(address).is_link_local)
    if found:
        return found[0]
    has_loopback = any(a.address == "::1" for a in psutil.net_if_addrs().get("lo", []))
    return "::1" if has_loopback else "EAFNOSUPPORT"


def test_a_wildcard_bind_lands_on_the_interface_and_nothing_else_changes(library):
    found = preloaded(library, "lo", str(library))
    assert found["0.0.0.0"] == "127.0.0.1" and found["::"] == _ipv6("lo")
    assert found["environ"] == [None, None], "the process itself no longer sees the library"
    assert found["child"] == "None", "what it starts runs without the library"


def test_a_family_the_interface_lacks_listens_on_loopback(library):
    found = preloaded(library, "no-such-nic", str(library))
    assert found["0.0.0.0"] == "127.0.0.1" and found["::"] == _ipv6("no-such-nic")


def test_a_network_card_gets_its_own_address():
    """On this machine's NICs (every interface with an IPv4 address but lo): the card's address."""
    built, _ = native.bind_library()
    cards = {
        name: next(a.address for a in addresses if a.family == socket.AF_INET)
        for name, addresses in psutil.net_if_addrs().items()
        if name != "lo" and any(a.family == socket.AF_INET for a in addresses)
    }
    assert cards, "no network card with an IPv4 address to bind to"
    for name, address in cards.items():
        found = preloaded(built, name, str(built))
        assert found["0.0.0.0"] == address, (name, found)
        assert found["::"] == _ipv6(name), (name, found)


def test_the_users_own_preloads_stay_for_the_children(library):
    libm = subprocess.run(
        [sys.executable, "-c", "import ctypes.util; print(ctypes.util.find_library('m'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    found = preloaded(library, "lo", f"{library}:{libm}")
    assert found["0.0.0.0"] == "127.0.0.1"
    assert found["environ"][0] == libm and found["child"] == libm
