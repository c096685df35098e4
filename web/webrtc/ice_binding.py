"""Where the bridge's ICE sockets bind.

aiortc has no setting for the addresses ICE uses: each peer's aioice Connection opens one UDP
socket on every local address that aioice.ice.get_host_addresses finds (all interfaces but
loopback), whatever --host says. install_ice_binding() is the one place the bridge changes
that: it replaces get_host_addresses with a function that returns the addresses of the
IceBinding in force (a context variable the bridge sets around one peer's negotiation,
`binding_in_force`, so it holds for every task aiortc starts for that peer and for nothing else
in the process), and wraps the loop's create_datagram_endpoint so that aioice's sockets take a
port of --udp-ports and a TURN allocation's socket (UDP or TCP) binds the same address. The mDNS
socket aioice opens to resolve a browser's `.local` candidates binds the wildcard (0.0.0.0:5353)
and joins the group on the default interface; under an IceBinding with addresses it binds the
group address instead and joins it only on the binding's IPv4 address (127.0.0.1 for an
IPv6-only binding: aioice's mDNS is IPv4 only), so it receives nothing from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aioice.ice as aioice_ice
import aioice.mdns as aioice_mdns


@dataclass(frozen=True)
class IceBinding:
    """Where one bridge's ICE sockets bind. `addresses` None: every address aioice finds (IPv6
    ones only with `ipv6`); `ports`: the --udp-ports range, None for any port."""
    addresses: tuple[str, ...] | None = None
    ipv6: bool = True
    ports: tuple[int, int] | None = None


# The IceBinding in force: set around one peer's negotiation (binding_in_force), None elsewhere.
ICE_BINDING: contextvars.ContextVar[IceBinding | None] = contextvars.ContextVar("rtmedia_ice_binding", default=None)
_aioice_host_addresses = aioice_ice.get_host_addresses
_aioice_create_mdns_protocol = aioice_mdns.create_mdns_protocol


@contextlib.contextmanager
def binding_in_force(binding: IceBinding) -> Iterator[None]:
    """Make `binding` the IceBinding in force for this task, and for the tasks it starts
    meanwhile (they copy the context), until the block ends."""
    token = ICE_BINDING.set(binding)
    try:
        yield
    finally:
        ICE_BINDING.reset(token)


async def ice_binding(host: str, ports: tuple[int, int] | None = None) -> IceBinding:
    """The IceBinding of a --host/--media-host value: a wildcard keeps aioice's own choice
    ("0.0.0.0": IPv4 only), an address is used as is, a name is resolved."""
    if host in ("", "::"):
        return IceBinding(ports=ports)
    if host == "0.0.0.0":
        return IceBinding(ipv6=False, ports=ports)
    try:
        return IceBinding(addresses=(str(ipaddress.ip_address(host)),), ports=ports)
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    return IceBinding(addresses=tuple(dict.fromkeys(str(info[4][0]) for info in infos)), ports=ports)


def _host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    """aioice.ice.get_host_addresses, narrowed to the IceBinding in force."""
    binding = ICE_BINDING.get()
    if binding is None:
        return _aioice_host_addresses(use_ipv4=use_ipv4, use_ipv6=use_ipv6)
    if binding.addresses is None:
        return _aioice_host_addresses(use_ipv4=use_ipv4, use_ipv6=use_ipv6 and binding.ipv6)
    return [a for a in binding.addresses if (use_ipv6 if ":" in a else use_ipv4)]


async def _create_mdns_protocol() -> aioice_mdns.MDnsProtocol:
    """aioice.mdns.create_mdns_protocol, narrowed to the IceBinding in force."""
    binding = ICE_BINDING.get()
    if binding is None or binding.addresses is None:
        return await _aioice_create_mdns_protocol()
    interface = next((a for a in binding.addresses if ":" not in a), "127.0.0.1")
    group = aioice_mdns.MDNS_ADDRESS
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((group, aioice_mdns.MDNS_PORT))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(group) + socket.inet_aton(interface))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
    except OSError:
        sock.close()
        raise
    _, protocol = await asyncio.get_running_loop().create_datagram_endpoint(aioice_mdns.MDnsProtocol, sock=sock)
    protocol._MDnsProtocol__joined = True  # joined above on `interface`; aioice would join on the default one
    return protocol


def install_ice_binding(loop: asyncio.AbstractEventLoop) -> None:
    """Make aioice follow the IceBinding in force (see above); idempotent, and a no-op for
    ICE outside a bridge's negotiation."""
    aioice_ice.get_host_addresses = _host_addresses
    aioice_mdns.create_mdns_protocol = _create_mdns_protocol
    if getattr(loop, "_rtmedia_ice_binding", False):
        return
    original = loop.create_datagram_endpoint

    async def create_datagram_endpoint(protocol_factory: Any, local_addr: Any = None, **kwargs: Any) -> Any:
        binding = ICE_BINDING.get()
        module = getattr(protocol_factory, "__module__", "") or ""
        if binding is None or not module.startswith("aioice") or kwargs.get("sock") is not None:
            return await original(protocol_factory, local_addr=local_addr, **kwargs)
        remote = kwargs.get("remote_addr")
        if local_addr is None and remote and binding.addresses:
            # A TURN allocation's socket: from the bridge's own address, not the wildcard.
            v6 = ":" in str(remote[0])
            local_addr = (next((a for a in binding.addresses if (":" in a) == v6), binding.addresses[0]), 0)
        if not (local_addr and local_addr[1] == 0 and binding.ports):
            return await original(protocol_factory, local_addr=local_addr, **kwargs)
        lo, hi = binding.ports
        candidates = list(range(lo, hi + 1))
        random.shuffle(candidates)
        for port in candidates:
            with contextlib.suppress(OSError):
                return await original(protocol_factory, local_addr=(local_addr[0], port), **kwargs)
        raise OSError(f"no free UDP port in {lo}-{hi} on {local_addr[0]} (--udp-ports)")

    original_tcp = loop.create_connection

    async def create_connection(protocol_factory: Any, host: Any = None, port: Any = None, **kwargs: Any) -> Any:
        binding = ICE_BINDING.get()
        module = getattr(protocol_factory, "__module__", "") or ""
        if binding is not None and binding.addresses and module.startswith("aioice") and not kwargs.get("local_addr"):
            # A TURN/TCP allocation's connection: from the bridge's own address too.
            v6 = ":" in str(host)
            kwargs["local_addr"] = (next((a for a in binding.addresses if (":" in a) == v6), binding.addresses[0]), 0)
        return await original_tcp(protocol_factory, host, port, **kwargs)

    loop.create_datagram_endpoint = create_datagram_endpoint  # type: ignore[method-assign]
    loop.create_connection = create_connection  # type: ignore[method-assign]
    loop._rtmedia_ice_binding = True  # type: ignore[attr-defined]
