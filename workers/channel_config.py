"""A worker's parameter-channel settings, from where its controller is.

A worker whose controller is on loopback keeps everything on this host: the channel's
defaults (its tcp server, if ever used, on 127.0.0.1). A worker whose controller is
elsewhere may have to serve parameters to other hosts: its tcp server binds the address
this host reaches the controller from (or `--param-host`) and is authenticated with CURVE
under a key pair made for this process. The public key travels inside each published
handle, through the controller's own CURVE-authenticated connection, so receivers know
whom they are pulling from and no secret has to be copied between hosts.

This module does not know which transport a transfer uses: the controller chooses.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import zmq

from flexmarl.runtime.params.types import ParamChannelConfig
from flexmarl.runtime.transport import is_loopback_host

__all__ = ["channel_config", "address_towards"]


def address_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket's
    connect only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as exc:
            raise OSError(f"no route from this host to the controller at {host} ({exc}); "
                          "pass --param-host with this host's address") from exc
        return probe.getsockname()[0]


def channel_config(controller_address: str, param_host: str = "") -> ParamChannelConfig:
    """Settings for a worker connected to `controller_address`; `param_host` is the address
    to serve parameters on (default: the one facing the controller)."""
    controller_host = urlsplit(controller_address).hostname or ""
    if not param_host and (not controller_host or is_loopback_host(controller_host)
                           or controller_address.startswith(("ipc://", "inproc://"))):
        return ParamChannelConfig()
    host = param_host or address_towards(controller_host)
    if is_loopback_host(host):
        return ParamChannelConfig(tcp_bind_host=host)
    public, secret = zmq.curve_keypair()
    return ParamChannelConfig(tcp_bind_host=host, curve_public_key=public.decode(), curve_secret_key=secret.decode())
