"""Fetching a URL a caller gave (an image to read), without letting the caller reach inside.

:func:`fetch_public` is the one way a service downloads from a caller-supplied address:

1. only ``http``/``https``, no user or password in the URL, a port given or the scheme's;
2. the host is resolved once, and *every* address it resolves to must be public
   (:func:`is_public_address`: not loopback, private, link-local — cloud metadata at
   169.254.169.254 —, shared, reserved, multicast or unspecified, IPv4-mapped IPv6 included),
   unless it lies in ``allowed_networks`` (an operator's explicit list, empty by default);
3. the connection goes to the checked address (so a second DNS answer cannot swap in an internal
   one), with the original ``Host`` header and TLS server name, and no credentials: no cookies,
   no ``Authorization``, nothing of the service's own;
4. redirects are followed only to the same scheme, host and port (at most :data:`MAX_REDIRECTS`),
   each hop checked again; a redirect elsewhere is refused;
5. the body is read up to ``max_bytes`` (a longer one is refused as soon as it passes), the whole
   exchange within ``timeout_s``.

Each refusal is a :class:`FetchError` saying why; the caller names the field.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urljoin, urlsplit

import httpx

MAX_REDIRECTS = 3
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchError(ValueError):
    """A URL that may not be fetched, or whose answer cannot be used; the message says why."""


def is_public_address(address: IPAddress) -> bool:
    """Whether ``address`` is reachable on the public internet (``is_global``), looking through
    IPv4-mapped and 6to4/Teredo-free forms; shared (100.64/10) and multicast count as internal."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def _resolve(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def parse_networks(networks: Sequence[str]) -> tuple[IPNetwork, ...]:
    """CIDR strings (an operator's allow-list) as networks; ``ValueError`` naming a bad one."""
    return tuple(ipaddress.ip_network(n, strict=False) for n in networks)


async def _checked_address(
    host: str, port: int, allowed: tuple[IPNetwork, ...], resolve: Resolver
) -> IPAddress:
    try:
        literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        try:
            found = await resolve(host, port)
        except (OSError, UnicodeError) as exc:
            raise FetchError(f"host {host!r} cannot be resolved: {exc}") from None
        addresses = [ipaddress.ip_address(a.split("%")[0]) for a in found]
        if not addresses:
            raise FetchError(f"host {host!r} resolves to no address")
    for address in addresses:
        if not is_public_address(address) and not any(address in net for net in allowed):
            raise FetchError(
                f"host {host!r} is an internal address ({address}); only public hosts are fetched"
            )
    return addresses[0]


def _target(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchError(f"scheme {parts.scheme!r} is not fetched (only http and https)")
    if parts.username is not None or parts.password is not None:
        raise FetchError("must not carry a user name or password")
    if not parts.hostname:
        raise FetchError("has no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise FetchError("has an invalid port") from None
    return parts.scheme, parts.hostname, port


async def fetch_public(
    url: str,
    *,
    max_bytes: int,
    timeout_s: float,
    allowed_networks: tuple[IPNetwork, ...] = (),
    resolve: Resolver = _resolve,
    transport: httpx.AsyncBaseTransport | None = None,
) -> bytes:
    """The body of ``url`` (``GET``, status 200), under the rules of the module docstring."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _fetch(url, max_bytes, allowed_networks, resolve, transport)
    except TimeoutError:
        raise FetchError(f"took longer than {timeout_s:g} s") from None


async def _fetch(
    url: str,
    max_bytes: int,
    allowed: tuple[IPNetwork, ...],
    resolve: Resolver,
    transport: httpx.AsyncBaseTransport | None,
) -> bytes:
    scheme, host, port = _target(url)
    async with httpx.AsyncClient(
        follow_redirects=False, trust_env=False, transport=transport, headers={"User-Agent": "forge"}
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            address = await _checked_address(host, port, allowed, resolve)
            parts = urlsplit(url)
            netloc = f"[{address}]" if address.version == 6 else str(address)
            pinned = parts._replace(netloc=f"{netloc}:{port}").geturl()
            default_port = port == (443 if scheme == "https" else 80)
            headers = {"Host": host if default_port else f"{host}:{port}", "Accept": "image/*"}
            extensions = {"sni_hostname": host} if scheme == "https" else {}
            try:
                async with client.stream("GET", pinned, headers=headers, extensions=extensions) as response:
                    if response.is_redirect:
                        location = urljoin(url, response.headers.get("location", ""))
                        if _target(location) != (scheme, host, port):
                            raise FetchError(
                                f"redirects to another host or scheme ({urlsplit(location).netloc})"
                            )
                        url = location
                        continue
                    if response.status_code != 200:
                        raise FetchError(f"answered HTTP {response.status_code}")
                    declared = response.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                        raise FetchError(f"is {declared} bytes; at most {max_bytes} are accepted")
                    body = bytearray()
                    async for piece in response.aiter_bytes():
                        body += piece
                        if len(body) > max_bytes:
                            raise FetchError(f"is more than {max_bytes} bytes")
                    return bytes(body)
            except httpx.HTTPError as exc:
                raise FetchError(f"cannot be fetched: {type(exc).__name__}: {exc}") from None
        raise FetchError(f"redirects more than {MAX_REDIRECTS} times")
