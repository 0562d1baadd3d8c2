"""Images at the edge: the ingress turns a chat request's image parts into decoded, hashed, preprocessed images and
the prompt with its placeholders expanded, or refuses the request with a 400 naming the content part. Nothing behind
the edge sees an image that failed here.

URLs: data: always; http(s):// only when the deployment allows remote URLs (the ingress would fetch whatever a client
names, so it is off by default); file:// only under the configured directory.
"""

from __future__ import annotations

import asyncio
import pathlib
import urllib.parse
import httpx

from cluster.config import MultimodalSettings
from engine.multimodal.processing import ImageItem, ImageLimits, MultimodalProcessor


class BadImage(ValueError):
    """A request the edge refuses because of an image; `param` names the content part."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class EdgeImages:
    def __init__(self, model_dir: str, settings: MultimodalSettings):
        self.settings = settings
        limits = ImageLimits(max_bytes=int(settings.max_image_bytes), max_pixels=settings.max_image_pixels)
        self.processor = MultimodalProcessor(model_dir, limits)
        self.image_token_id = self.processor.image_token_id

    def check_text(self, ids: list[int], param: str = "prompt") -> None:
        """A prompt that brings no image may hold no image placeholder either."""
        found = sum(1 for t in ids if t == self.image_token_id)
        if found:
            raise BadImage(f"{param}: holds {found} image placeholder(s) but no image was sent (send images as "
                           "image_url parts of a chat message)", param)

    async def prepare(self, ids: list[int], parts: list[tuple[str, str]]) -> tuple[list[int], tuple[ImageItem, ...]]:
        """parts: (content part name, url) in prompt order -> the prompt with each placeholder expanded, and the
        images. Raises BadImage."""
        limit = self.settings.max_images_per_request
        if len(parts) > limit:
            raise BadImage(f"{parts[limit][0]}: more than {limit} images in one request "
                           "(multimodal.max_images_per_request)", parts[limit][0])
        self._check_count(ids, parts)
        data = [await self._fetch(name, url) for name, url in parts]
        names = [name for name, _ in parts]
        try:
            # decoding is CPU work: off the event loop
            mm = await asyncio.to_thread(self.processor.process, ids, data, names)
        except ValueError as e:
            raise BadImage(str(e), next((n for n in names if str(e).startswith(n)), "messages")) from None
        return list(mm.token_ids), mm.images

    def _check_count(self, ids: list[int], parts: list[tuple[str, str]]) -> None:
        found = sum(1 for t in ids if t == self.image_token_id)
        if found == len(parts):
            return
        if len(parts) > found:
            name = parts[found][0]
            raise BadImage(f"{name}: {len(parts)} image parts, but the rendered prompt has {found} image "
                           "placeholder(s) (the chat template places one per image part)", name)
        raise BadImage(f"messages: the rendered prompt has {found} image placeholder(s) for {len(parts)} image "
                       "part(s); a text part holds an image token", "messages")

    async def _fetch(self, name: str, url: str) -> str | bytes:
        """A data: URL as is (decoded by the processor, within limits); a permitted remote or local one's bytes."""
        where = f"{name}.image_url.url"
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return url
        if scheme in ("http", "https"):
            if not self.settings.allow_remote_urls:
                raise BadImage(f"{where}: http(s) image URLs are not allowed by this deployment "
                               "(multimodal.allow_remote_urls); send the image as a data: URL", name)
            return await self._get(where, name, url)
        if scheme == "file":
            return self._read_local(where, name, url)
        raise BadImage(f"{where}: unsupported image URL scheme {scheme or url[:20]!r}; expected data:", name)

    async def _get(self, where: str, name: str, url: str) -> bytes:
        limit = int(self.settings.max_image_bytes)
        try:
            async with httpx.AsyncClient(timeout=self.settings.fetch_timeout_s, follow_redirects=False) as client:
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise BadImage(f"{where}: fetching the image gave HTTP {response.status_code}", name)
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise BadImage(f"{where}: the image is over the limit of {limit} bytes", name)
                    return bytes(body)
        except httpx.HTTPError as e:
            raise BadImage(f"{where}: could not fetch the image: {e}", name) from None

    def _read_local(self, where: str, name: str, url: str) -> bytes:
        root = self.settings.allowed_local_media_path
        if root is None:
            raise BadImage(f"{where}: file:// image URLs are not allowed by this deployment "
                           "(multimodal.allowed_local_media_path)", name)
        path = pathlib.Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise BadImage(f"{where}: no image file at that path under the allowed directory", name)
        limit = int(self.settings.max_image_bytes)
        if path.stat().st_size > limit:
            raise BadImage(f"{where}: {path.stat().st_size} bytes is over the limit of {limit}", name)
        return path.read_bytes()
