"""Images in, placeholders out: decoding under limits, the checkpoint's own processor, placeholder expansion, hashes.

A prompt carries one image token per image. Each is expanded to that image's token count (what transformers'
LlavaProcessor does to the text before tokenizing; the image token is a special token, so expanding token ids gives
the same ids), and each image's range of positions is reported so its embeddings can be spliced there. Each image
also gets a content hash: 8 int32 of a BLAKE2b digest over its decoded pixels, the processor's configuration and the
model's fingerprint, so neither another image nor the same image through another processor or model shares it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import pathlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import transformers
from PIL import Image, UnidentifiedImageError

from engine.multimodal.vision import load_vision_spec

HASH_WORDS = 8  # int32 words per content hash (256 bits)
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


@dataclass(frozen=True)
class ImageLimits:
    """What an image may cost before it is decoded. max_pixels stays below PIL's own bomb threshold (~89M)."""

    max_bytes: int = 20 * 2**20  # encoded size
    max_pixels: int = 4096 * 4096  # width * height
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # PIL decoders tried; no others are opened

    def __post_init__(self):
        if self.max_bytes < 1 or self.max_pixels < 1 or not self.formats:
            raise ValueError(f"ImageLimits needs positive limits and at least one format; got {self}")
        Image.init()  # registers every PIL plugin, so OPEN lists all the formats this PIL can decode
        unknown = [f for f in self.formats if f not in Image.OPEN]
        if unknown:
            raise ValueError(f"ImageLimits: PIL cannot open format(s) {', '.join(unknown)}")


@dataclass(frozen=True)
class ImageItem:
    """One image after preprocessing."""

    pixel_values: torch.Tensor  # (C, H, W) float32, the checkpoint processor's output
    content_hash: tuple[int, ...]  # HASH_WORDS int32
    num_tokens: int  # embeddings the vision encoder makes of it = placeholder tokens in the prompt


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one image's embeddings go: token positions [offset, offset + length) of the expanded prompt."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultimodalPrompt:
    token_ids: tuple[int, ...]  # the prompt with each image token expanded
    images: tuple[ImageItem, ...]
    ranges: tuple[PlaceholderRange, ...]  # one per image, in prompt order

    def pixel_values(self) -> torch.Tensor:
        """(num_images, C, H, W): the vision encoder's input."""
        return torch.stack([item.pixel_values for item in self.images])

    @property
    def content_hashes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(item.content_hash for item in self.images)


class MultimodalProcessor:
    """A LLaVA checkpoint's processor (PIL backend) with decoding limits, placeholder expansion and content hashes."""

    def __init__(self, model_dir, limits: ImageLimits = ImageLimits()):
        spec = load_vision_spec(model_dir)
        if spec is None:
            raise ValueError(f"{model_dir}: a text-only checkpoint takes no images")
        self.limits = limits
        # PIL, not torchvision: the backend changes the resampling and so the pixel values.
        processor = transformers.AutoProcessor.from_pretrained(pathlib.Path(model_dir), backend="pil")
        self.image_processor = processor.image_processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = spec.image_token_id
        self.tokens_per_image = spec.tokens_per_image
        self.image_size = spec.image_size
        self.identity = _identity(self.image_processor, spec.tokens_per_image, spec.fingerprint)

    def load_image(self, image, index: int = 0, where: str | None = None) -> Image.Image:
        """A PIL image, raw encoded bytes, or a data: URL -> a decoded PIL image (its first frame), within limits.
        Errors name `where` (default: images[index])."""
        return decode_image(image, self.limits, where or f"images[{index}]")

    def preprocess(self, images: Sequence, names: Sequence[str] | None = None) -> list[ImageItem]:
        """Decodes, hashes and runs the checkpoint's image processor on each image; errors name names[i] (default:
        images[i])."""
        items = []
        for i, image in enumerate(images):
            where = names[i] if names is not None else f"images[{i}]"
            decoded = self.load_image(image, i, where)
            pixels = self.image_processor(decoded, return_tensors="pt")["pixel_values"][0]  # (C, H, W)
            if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
                raise ValueError(f"{where}: the processor made {tuple(pixels.shape[-2:])} pixels, the vision "
                                 f"tower takes {self.image_size}x{self.image_size}; the checkpoint is inconsistent")
            items.append(ImageItem(pixels.float(), image_hash(decoded, self.identity), self.tokens_per_image))
        return items

    def process(self, prompt: str | Sequence[int], images: Sequence, names: Sequence[str] | None = None
                ) -> MultimodalPrompt:
        """The prompt (text, tokenized as the processor's tokenizer does, or token ids) with one image token per image.
        names: what errors call each image (default images[i])."""
        if isinstance(images, (str, bytes, Image.Image)):
            images = [images]  # one image, not a sequence of characters or bytes
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        count_placeholders(token_ids, self.image_token_id, len(images))  # before decoding anything
        items = self.preprocess(images, names)
        expanded, ranges = expand_placeholders(token_ids, self.image_token_id, [it.num_tokens for it in items])
        return MultimodalPrompt(tuple(expanded), tuple(items), tuple(ranges))


def _identity(image_processor, tokens_per_image: int, fingerprint: str) -> bytes:
    """What, besides the pixels, decides an image's embeddings: the processor (its class and configuration, so its
    backend), the placeholder count, the model."""
    config = json.dumps(image_processor.to_dict(), sort_keys=True, default=str)
    return f"{type(image_processor).__name__}|{config}|{tokens_per_image}|{fingerprint}".encode()


def image_hash(image: Image.Image, identity: bytes) -> tuple[int, ...]:
    """HASH_WORDS signed int32 (little-endian words of a 256-bit BLAKE2b) of the decoded image and identity.

    Mode, size, palette and transparency are hashed with the raw pixels: each changes what the processor sees."""
    h = hashlib.blake2b(digest_size=4 * HASH_WORDS, person=b"raypd-image-v1")
    for part in (identity, image.mode.encode(), repr(image.size).encode(), _palette(image),
                 repr(image.info.get("transparency")).encode()):
        h.update(struct.pack("<Q", len(part)))  # length-prefixed, so no two sequences of parts concatenate alike
        h.update(part)
    h.update(image.tobytes())
    return struct.unpack(f"<{HASH_WORDS}i", h.digest())


def _palette(image: Image.Image) -> bytes:
    if image.palette is None:
        return b""
    mode, data = image.palette.getdata()
    return mode.encode() + b"|" + data


def decode_image(image, limits: ImageLimits, where: str = "image") -> Image.Image:
    """PIL image, bytes or data: URL -> a loaded PIL image; ValueError naming `where` and the problem otherwise."""
    if isinstance(image, Image.Image):
        return _load(image, limits, where)
    if isinstance(image, str):
        image = _data_url_bytes(image, limits, where)
    if not isinstance(image, (bytes, bytearray, memoryview)):
        raise ValueError(f"{where}: expected a PIL image, encoded image bytes or a data: URL, got "
                         f"{type(image).__name__}")
    data = bytes(image)
    if len(data) > limits.max_bytes:
        raise ValueError(f"{where}: {len(data)} bytes is over the limit of {limits.max_bytes}")
    try:
        opened = Image.open(io.BytesIO(data), formats=list(limits.formats))  # reads the header only
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where}: refused as a decompression bomb ({e})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{where}: not a decodable image (formats accepted: {', '.join(limits.formats)}): {e}") \
            from None
    return _load(opened, limits, where)


def _load(image: Image.Image, limits: ImageLimits, where: str) -> Image.Image:
    # The pixel count comes from the header: a bomb is refused before a single pixel is decoded.
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"{where}: image of {width}x{height} pixels is empty")
    if width * height > limits.max_pixels:
        raise ValueError(f"{where}: {width}x{height} = {width * height} pixels is over the limit of "
                         f"{limits.max_pixels}")
    try:
        image.load()  # an animated image loads its first frame, the one the processor reads
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where}: refused as a decompression bomb ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as e:
        raise ValueError(f"{where}: truncated or corrupt image data: {e}") from None
    return image


def _data_url_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    match = _DATA_URL.match(url)
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ValueError(f"{where}: only data: URLs (data:image/...;base64,...) are accepted here, got {shown!r}")
    mime, payload = match["mime"], url[match.end():]
    if mime is not None and not mime.lower().startswith("image/"):
        raise ValueError(f"{where}: data: URL of media type {mime!r}, expected image/*")
    if not match["b64"]:
        raise ValueError(f"{where}: data: URL is not base64-encoded (expected ';base64,')")
    if len(payload) // 4 * 3 > limits.max_bytes:  # refused before decoding a string that large
        raise ValueError(f"{where}: ~{len(payload) // 4 * 3} bytes is over the limit of {limits.max_bytes}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: data: URL has invalid base64: {e}") from None


def count_placeholders(token_ids: Sequence[int], image_token_id: int, num_images: int) -> int:
    """The number of image tokens in the prompt; ValueError unless it equals num_images."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != num_images:
        raise ValueError(f"the prompt has {found} image placeholder(s) (token id {image_token_id}) for "
                         f"{num_images} image(s): give one placeholder per image")
    return found


def expand_placeholders(
    token_ids: Sequence[int], image_token_id: int, num_tokens: Sequence[int]
) -> tuple[list[int], list[PlaceholderRange]]:
    """Repeats the i-th image token num_tokens[i] times; returns the ids and each image's range of positions."""
    count_placeholders(token_ids, image_token_id, len(num_tokens))
    out: list[int] = []
    ranges: list[PlaceholderRange] = []
    for token in token_ids:
        if token != image_token_id:
            out.append(token)
            continue
        n = num_tokens[len(ranges)]
        ranges.append(PlaceholderRange(len(out), n))
        out.extend([image_token_id] * n)
    return out, ranges


def locate_placeholders(
    token_ids: Sequence[int], image_token_id: int, num_tokens: Sequence[int]
) -> tuple[list[int], list[PlaceholderRange]]:
    """The expanded prompt and each image's range, from a prompt in either form: one image token per image (a user's
    prompt: expanded here) or already expanded (an owner expands before passing a prompt on: image i is num_tokens[i]
    consecutive image tokens, back-to-back images one run). ValueError if the image tokens fit neither."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found == len(num_tokens):
        return expand_placeholders(token_ids, image_token_id, num_tokens)
    if found != sum(num_tokens):
        raise ValueError(f"the prompt has {found} image token(s) (id {image_token_id}) for {len(num_tokens)} "
                         f"image(s) of {sum(num_tokens)} tokens: give one placeholder per image")
    ranges: list[PlaceholderRange] = []
    pos = 0
    while pos < len(token_ids):
        if token_ids[pos] != image_token_id:
            pos += 1
            continue
        n = num_tokens[len(ranges)]
        if any(t != image_token_id for t in token_ids[pos:pos + n]) or pos + n > len(token_ids):
            raise ValueError(f"image {len(ranges)} needs {n} consecutive image tokens from position {pos}")
        ranges.append(PlaceholderRange(pos, n))
        pos += n
    return list(token_ids), ranges


def embeddings_in_span(
    ranges: Sequence[PlaceholderRange], embeddings: Sequence[torch.Tensor], start: int, num_new: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The image embeddings a prefill chunk of positions [start, start + num_new) needs, or None if it needs none.

    embeddings[i] is image i's (length_i, hidden). Returns (rows (R,) long, relative to the chunk's first row; the
    embeddings (R, hidden)): add the chunk's first flat-batch row to rows for CausalLM.forward's row_embeds. A chunk
    may cut an image anywhere.
    """
    rows, parts = [], []
    end = start + num_new
    for r, emb in zip(ranges, embeddings, strict=True):
        if emb.shape[0] != r.length:
            raise ValueError(f"image at position {r.offset}: {emb.shape[0]} embeddings for {r.length} placeholders")
        lo, hi = max(r.offset, start), min(r.end, end)
        if lo < hi:
            rows.append(torch.arange(lo - start, hi - start))
            parts.append(emb[lo - r.offset : hi - r.offset])
    if not rows:
        return None
    return torch.cat(rows), torch.cat(parts)
