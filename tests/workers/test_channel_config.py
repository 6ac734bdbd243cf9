"""A worker's parameter-channel settings follow where its controller is: loopback keeps
the defaults; a controller elsewhere makes the worker serve parameters on the address that
faces it, authenticated with a CURVE key pair of its own."""

import socket

import pytest
import torch

from flexmarl.runtime.params.channel import ParamChannel
from flexmarl.workers import channel_config as cc


def test_a_loopback_controller_keeps_parameters_on_loopback():
    for address in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "ipc:///tmp/ctl"):
        config = cc.channel_config(address)
        assert config.tcp_bind_host == "127.0.0.1" and config.curve_secret_key is None


def test_a_remote_controller_makes_the_worker_serve_on_the_address_facing_it_with_curve(monkeypatch):
    monkeypatch.setattr(cc, "address_towards", lambda host: {"10.20.0.1": "10.20.0.7"}[host])
    config = cc.channel_config("tcp://10.20.0.1:5555")
    assert config.tcp_bind_host == "10.20.0.7" and config.tcp_advertise_host is None
    assert len(config.curve_public_key) == 40 and len(config.curve_secret_key) == 40
    assert cc.channel_config("tcp://10.20.0.1:5555").curve_public_key != config.curve_public_key  # per process
    ParamChannel(config).close()  # accepted: off loopback, with keys


def test_param_host_names_the_address_explicitly(monkeypatch):
    monkeypatch.setattr(cc, "address_towards", lambda host: pytest.fail("no route lookup when told"))
    assert cc.channel_config("tcp://10.20.0.1:5555", param_host="10.30.0.2").tcp_bind_host == "10.30.0.2"


def test_a_worker_config_moves_parameters_over_curve_on_a_real_non_loopback_address():
    try:
        host = cc.address_towards("192.0.2.1")  # TEST-NET-1: any default route will do
    except OSError:
        pytest.skip("this host has no non-loopback route")
    if host.startswith("127."):
        pytest.skip("this host's only address is loopback")
    config = cc.channel_config(f"tcp://{host}:5555")
    assert config.tcp_bind_host == host and config.curve_secret_key
    state = {"w": torch.randn(64, 64), "b": torch.arange(10)}
    with ParamChannel(config) as publisher, ParamChannel() as receiver:
        handle = publisher.publish(state, agent="a", version=1, transport="tcp")
        assert handle.endpoint.startswith(f"tcp://{host}:") and handle.server_key == config.curve_public_key
        got = receiver.receive(handle)
        assert all(torch.equal(got[k], v) for k, v in state.items())
        receiver.release(handle)


def test_no_route_to_the_controller_says_what_to_do(monkeypatch):
    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError("Network is unreachable")

    monkeypatch.setattr(cc.socket, "socket", NoRoute)
    with pytest.raises(OSError, match="--param-host"):
        cc.channel_config("tcp://10.20.0.1:5555")
