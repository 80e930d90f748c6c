"""The interface gloo listens on, and which processes count as one host (shadowgba.network)."""

from __future__ import annotations

import os
import socket

import pytest

from shadowgba import SetupError, network


def test_the_interface_is_the_one_that_reaches_the_master() -> None:
    loopback = network.listen_interface("127.0.0.1")
    assert loopback == network.listen_interface("localhost")
    assert socket.if_nametoindex(loopback) > 0
    with pytest.raises(SetupError, match="no IPv4 route to MASTER_ADDR 256.0.0.1 .*set GLOO_SOCKET_IFNAME"):
        network.listen_interface("256.0.0.1")


def test_gloo_socket_ifname_is_set_from_master_addr_and_a_users_choice_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SetupError, match="MASTER_ADDR and MASTER_PORT are not set"):
        network.use_interface_to_master()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert network.use_interface_to_master() == network.listen_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == network.listen_interface("127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchnic0")  # a typo: named, with the host's interfaces
    with pytest.raises(SetupError, match=r"GLOO_SOCKET_IFNAME=nosuchnic0: this host has no interface "
                                         r"'nosuchnic0' with an IPv4 address \(its interfaces: .*lo"):
        network.use_interface_to_master()


def test_a_host_is_one_kernel_and_one_network_namespace() -> None:
    identity = network.host_identity()
    assert identity == network.host_identity()
    assert identity.endswith(f"/{os.stat('/proc/self/ns/net').st_ino}")
