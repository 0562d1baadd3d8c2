"""The ingress's image step without Ray: which URLs it fetches, under which limits, and what it refuses (BadImage,
a 400 at the edge) naming the content part."""

from __future__ import annotations

import asyncio
import http.server
import io
import threading

import pytest

from cluster.config import MultimodalSettings
from cluster.edge.images import BadImage, EdgeImages
from tests.engine.images import random_images

PART = "messages[0].content[1]"


def _png(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    random_images(1, seed=seed)[0].save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava(llava_factory):
    return str(llava_factory())


def edge(llava, **settings) -> EdgeImages:
    return EdgeImages(llava, MultimodalSettings(**settings))


def prepare(images: EdgeImages, url: str):
    ids = images.processor.tokenizer.encode("look: <image>")
    return asyncio.run(images.prepare(ids, [(PART, url)]))


@pytest.fixture
def http_server():
    """A local HTTP server: /img.png is an image, /big is over 64 KiB, anything else 404."""
    body = {"/img.png": _png(1), "/big": b"x" * (100 * 1024)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body.get(self.path)
            self.send_response(200 if data else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_urls_only_when_allowed(llava, http_server):
    with pytest.raises(BadImage, match="allow_remote_urls") as err:
        prepare(edge(llava), f"{http_server}/img.png")
    assert err.value.param == PART
    ids, items = prepare(edge(llava, allow_remote_urls=True), f"{http_server}/img.png")
    assert len(items) == 1 and len(ids) > 16
    allowed = edge(llava, allow_remote_urls=True, max_image_bytes="64KiB")
    with pytest.raises(BadImage, match="over the limit"):
        prepare(allowed, f"{http_server}/big")
    with pytest.raises(BadImage, match="HTTP 404"):
        prepare(allowed, f"{http_server}/missing")


def test_file_urls_only_under_the_allowed_directory(llava, tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "secret"
    inside.mkdir(), outside.mkdir()
    (inside / "a.png").write_bytes(_png(2))
    (outside / "b.png").write_bytes(_png(3))
    with pytest.raises(BadImage, match="allowed_local_media_path"):
        prepare(edge(llava), f"file://{inside / 'a.png'}")
    images = edge(llava, allowed_local_media_path=str(inside))
    assert len(prepare(images, f"file://{inside / 'a.png'}")[1]) == 1
    for url in (f"file://{outside / 'b.png'}", f"file://{inside}/../secret/b.png"):
        with pytest.raises(BadImage, match="under the allowed directory"):
            prepare(images, url)


def test_other_schemes_are_refused(llava):
    with pytest.raises(BadImage, match="unsupported image URL scheme 'ftp'"):
        prepare(edge(llava), "ftp://host/a.png")
