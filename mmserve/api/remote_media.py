"""Fetches http(s) media for allow-listed hosts: every redirect hop re-checked, private / loopback / link-local
addresses refused, the connection pinned to the checked address (no DNS rebinding), time and size capped."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from mmserve.api.errors import APIError

_MAX_REDIRECTS = 3


class RemoteFetcher:
    def __init__(
        self,
        allowed_domains: tuple[str, ...],
        *,
        timeout_s: float = 10.0,
        allow_private: bool = False,  # only for tests and trusted networks
    ) -> None:
        self.allowed = tuple(d.lower().strip(".") for d in allowed_domains)
        self.timeout_s = timeout_s
        self.allow_private = allow_private

    def allows(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower().strip(".")
        return any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in self.allowed)

    async def fetch(self, url: str, max_bytes: int, param: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        try:
            async with httpx.AsyncClient(
                follow_redirects=False, timeout=self.timeout_s, trust_env=False
            ) as client:
                for _ in range(_MAX_REDIRECTS + 1):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    result = await asyncio.wait_for(self._hop(client, url, max_bytes, param), remaining)
                    if isinstance(result, bytes):
                        return result
                    url = result  # a redirect target, checked again on the next hop
        except (TimeoutError, asyncio.TimeoutError):
            raise APIError(400, f"{param}: fetching the URL timed out after {self.timeout_s:g} s",
                           code="remote_media_timeout", param=param) from None  # fmt: skip
        except httpx.HTTPError:
            raise APIError(400, f"{param}: the URL could not be fetched", code="remote_media_error",
                           param=param) from None  # fmt: skip
        raise APIError(
            400, f"{param}: more than {_MAX_REDIRECTS} redirects", code="remote_media_error", param=param
        )

    async def _hop(self, client: httpx.AsyncClient, url: str, max_bytes: int, param: str) -> bytes | str:
        """The body, or the next URL when the answer is a redirect."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise APIError(
                400, f"{param}: only http(s) URLs can be fetched", code="remote_media_error", param=param
            )
        if not self.allows(url):
            raise APIError(400, f"{param}: the host {parts.hostname!r} is not in --allowed-media-domains",
                           code="remote_media_disabled", param=param)  # fmt: skip
        address = await self._public_address(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                             param)  # fmt: skip
        netloc = f"[{address}]" if ":" in address else address
        if parts.port:
            netloc += f":{parts.port}"
        pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*, video/*"}
        extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
        request = client.build_request("GET", pinned, headers=headers, extensions=extensions)
        response = await client.send(request, stream=True)
        try:
            if response.is_redirect:
                return urljoin(url, response.headers.get("location", ""))
            if response.status_code != 200:
                raise APIError(400, f"{param}: the URL answered HTTP {response.status_code}",
                               code="remote_media_error", param=param)  # fmt: skip
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise self._too_big(max_bytes, param)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise self._too_big(max_bytes, param)
            return bytes(body)
        finally:
            await response.aclose()

    async def _public_address(self, host: str, port: int, param: str) -> str:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise APIError(400, f"{param}: the host {host!r} could not be resolved", code="remote_media_error",
                           param=param) from None  # fmt: skip
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        if not self.allow_private and any(not a.is_global or a.is_multicast for a in addresses):
            raise APIError(400, f"{param}: the host {host!r} resolves to a private or reserved address",
                           code="remote_media_forbidden", param=param)  # fmt: skip
        addresses.sort(key=lambda a: a.version)  # IPv4 first: the more likely to be reachable
        return str(addresses[0])

    @staticmethod
    def _too_big(max_bytes: int, param: str) -> APIError:
        return APIError(400, f"{param}: the remote file is larger than {max_bytes} bytes",
                        code="remote_media_too_large", param=param)  # fmt: skip
