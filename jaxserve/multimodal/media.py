"""An image part's URL -> its bytes, under the server's media rules (vLLM's flags).

- ``data:image/...;base64,...``: always accepted;
- ``http(s)://``: fetched with a time and a size limit, from any host unless
  ``allowed_domains`` is given (vLLM's ``--allowed-media-domains``), then only from
  those hosts;
- ``file://`` and plain paths: only under ``allowed_local_path`` (vLLM's
  ``--allowed-local-media-path``), off by default.

Every refusal is a ValueError that says why (the server answers 400).
"""
from __future__ import annotations

import dataclasses
import os
import urllib.parse
import urllib.request

from jaxserve.multimodal.image import decode_data_url

DEFAULT_FETCH_TIMEOUT = 10.0  # seconds, as vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_IMAGE_BYTES = 20 << 20


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] | None = None  # None: any host
    allowed_local_path: str | None = None  # None: no local files
    timeout: float = DEFAULT_FETCH_TIMEOUT
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def fetch(self, url: str) -> bytes:
        """The image bytes ``url`` names (see the module docstring)."""
        if not isinstance(url, str) or not url:
            raise ValueError("image_url.url must be a non-empty string")
        if url.startswith("data:"):
            return decode_data_url(url)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme in ("http", "https"):
            host = (parsed.hostname or "").lower()
            if self.allowed_domains is not None and host not in self.allowed_domains:
                raise ValueError(f"image URL host {host!r} is not allowed (--allowed-media-domains)")
            return self._download(url)
        if parsed.scheme in ("file", ""):
            return self._read_local(urllib.parse.unquote(parsed.path if parsed.scheme else url))
        raise ValueError(f"image URL scheme {parsed.scheme!r} is not supported (data:, http(s):, file:)")

    def _download(self, url: str) -> bytes:
        req = urllib.request.Request(url, headers={"User-Agent": "jaxserve"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 (scheme checked)
                data = resp.read(self.max_bytes + 1)
        except OSError as e:
            raise ValueError(f"the image URL could not be fetched: {e}") from None
        if len(data) > self.max_bytes:
            raise ValueError(f"the image at the URL is larger than {self.max_bytes} bytes")
        return data

    def _read_local(self, path: str) -> bytes:
        if self.allowed_local_path is None:
            raise ValueError("local image files are not allowed (start the server with --allowed-local-media-path)")
        root = os.path.realpath(self.allowed_local_path)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise ValueError(f"the image file is outside --allowed-local-media-path ({root})")
        try:
            if os.path.getsize(real) > self.max_bytes:
                raise ValueError(f"the image file is larger than {self.max_bytes} bytes")
            with open(real, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"the image file could not be read: {e}") from None
