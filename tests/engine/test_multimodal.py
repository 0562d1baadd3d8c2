"""Image decoding under limits, the checkpoint's processor, placeholder expansion, content hashes, chunk splicing."""

from __future__ import annotations

import base64
import io
import json
import shutil
import zlib

import pytest
import torch
import transformers
from PIL import Image

from engine.multimodal.processing import (
    HASH_WORDS,
    ImageLimits,
    MultimodalProcessor,
    PlaceholderRange,
    decode_image,
    embeddings_in_span,
    expand_placeholders,
    locate_placeholders,
)
from tests.engine.images import random_images


@pytest.fixture(scope="module")
def clip_dir(llava_factory):
    return llava_factory(vision="clip")


@pytest.fixture(scope="module")
def proc(clip_dir):
    return MultimodalProcessor(clip_dir)


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


PROMPTS = {
    "one": "Describe <image> briefly.",
    "two": "<|user|>\nfirst <image> then <image> end",
    "back_to_back": "look: <image><image> now",
    "at_start": "<image> what is it?",
}


@pytest.mark.parametrize("vision", ["clip", "siglip"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_expansion_and_pixels_match_llava_processor(llava_factory, vision, prompt):
    path = llava_factory(vision=vision)
    text = PROMPTS[prompt]
    images = random_images(text.count("<image>"), seed=3)
    ref = transformers.AutoProcessor.from_pretrained(path)(images=images, text=text, return_tensors="pt")
    got = MultimodalProcessor(path).process(text, images)
    assert list(got.token_ids) == ref["input_ids"][0].tolist()
    assert torch.equal(got.pixel_values(), ref["pixel_values"])
    image_id = MultimodalProcessor(path).image_token_id
    for r in got.ranges:  # each range is exactly one image's run of placeholders
        assert set(got.token_ids[r.offset : r.end]) == {image_id} and r.length == 16
    assert sum(r.length for r in got.ranges) == got.token_ids.count(image_id)


def test_ranges_of_back_to_back_images_are_adjacent(proc):
    got = proc.process("<image><image>x", random_images(2))
    assert got.ranges == (PlaceholderRange(0, 16), PlaceholderRange(16, 16))


def test_token_ids_in_give_the_same_prompt(proc):
    images = random_images(2)
    text = PROMPTS["two"]
    assert proc.process(proc.tokenizer.encode(text), images).token_ids == proc.process(text, images).token_ids


@pytest.mark.parametrize("text, count", [("one <image>", 2), ("<image><image> two", 1), ("none", 1), ("<image>", 0)])
def test_placeholder_count_mismatch_is_refused(proc, text, count):
    with pytest.raises(ValueError, match=f"{text.count('<image>')} image placeholder.*for {count} image"):
        proc.process(text, random_images(count))


def test_expand_placeholders_alone():
    ids, ranges = expand_placeholders([5, 9, 9, 6, 9], 9, [2, 3, 1])
    assert ids == [5, 9, 9, 9, 9, 9, 6, 9]
    assert ranges == [PlaceholderRange(1, 2), PlaceholderRange(3, 3), PlaceholderRange(7, 1)]


def test_same_image_any_encoding_same_hash(proc):
    image = random_images(1)[0]
    png = _encoded(image)
    hashes = {item.content_hash for item in proc.preprocess([image, png, _data_url(png), bytearray(png)])}
    assert len(hashes) == 1
    (h,) = hashes
    assert len(h) == HASH_WORDS and all(-(2**31) <= w < 2**31 for w in h)


def test_different_images_different_hashes(proc):
    images = random_images(8, seed=5)
    one_pixel = images[0].copy()
    one_pixel.putpixel((0, 0), tuple(255 - c for c in one_pixel.getpixel((0, 0))))
    hashes = [item.content_hash for item in proc.preprocess([*images, one_pixel])]
    assert len(set(hashes)) == len(hashes)


def test_palette_is_part_of_the_hash(proc):
    # Same indices, different colours: the bytes of the pixels alone would collide.
    a = Image.new("P", (20, 20))
    a.putpalette([0, 0, 0, 255, 0, 0] * 128)
    b = a.copy()
    b.putpalette([0, 0, 0, 0, 255, 0] * 128)
    assert a.tobytes() == b.tobytes()
    ha, hb = (item.content_hash for item in proc.preprocess([a, b]))
    assert ha != hb


def test_same_image_other_processor_or_model_other_hash(llava_factory, clip_dir, proc, tmp_path):
    image = random_images(1)[0]
    base = proc.preprocess([image])[0].content_hash
    other = tmp_path / "other-processor"
    shutil.copytree(clip_dir, other)
    config = json.loads((other / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    (other / "processor_config.json").write_text(json.dumps(config))
    assert MultimodalProcessor(other).preprocess([image])[0].content_hash != base
    other_model = llava_factory(vision="clip", seed=1)  # same processor files, other weights
    assert MultimodalProcessor(other_model).preprocess([image])[0].content_hash != base
    assert MultimodalProcessor(llava_factory(vision="siglip")).preprocess([image])[0].content_hash != base


def test_text_only_checkpoint_takes_no_images(tiny_llama):
    with pytest.raises(ValueError, match="text-only"):
        MultimodalProcessor(tiny_llama)


# --- decoding under limits ------------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny IDAT: what a decompression bomb looks like."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_limits_refuse_large_images_before_decoding(proc):
    with pytest.raises(ValueError, match=r"images\[1\]: 5000x5000 = 25000000 pixels is over the limit"):
        proc.process("<image><image>", [random_images(1)[0], _png_header_only(5000, 5000)])
    big = _encoded(random_images(1)[0].resize((64, 64)))  # noise: no smaller than its pixels
    with pytest.raises(ValueError, match=r"images\[0\]: \d+ bytes is over the limit of 1000"):
        decode_image(big, ImageLimits(max_bytes=1000), "images[0]")
    with pytest.raises(ValueError, match=r"~\d+ bytes is over the limit of 1000"):  # before the base64 is decoded
        decode_image(_data_url(big), ImageLimits(max_bytes=1000))
    with pytest.raises(ValueError, match="64x64 = 4096 pixels is over the limit of 4095"):
        decode_image(big, ImageLimits(max_pixels=4095))
    with pytest.raises(ValueError, match="64x64 = 4096 pixels"):
        decode_image(Image.new("RGB", (64, 64)), ImageLimits(max_pixels=4095))  # a PIL image in-process too


def test_decompression_bomb_is_refused_by_pil_beyond_our_limit():
    # Over twice PIL's MAX_IMAGE_PIXELS, PIL itself refuses at open; with our limit raised, its refusal is ours.
    limits = ImageLimits(max_pixels=10**12)
    with pytest.raises(ValueError, match="decompression bomb"):
        decode_image(_png_header_only(30_000, 30_000), limits)


def test_truncated_image_is_refused(proc):
    data = _encoded(random_images(1)[0], "PNG")
    with pytest.raises(ValueError, match=r"images\[0\]: truncated or corrupt"):
        proc.process("<image>", [data[: len(data) // 2]])
    jpeg = _encoded(random_images(1)[0], "JPEG")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        decode_image(jpeg[: len(jpeg) // 2], ImageLimits())


@pytest.mark.parametrize("payload, message", [
    (b"definitely not an image", "not a decodable image"),
    (b"", "not a decodable image"),
    ("http://example.com/cat.png", "only data: URLs"),
    ("file:///etc/passwd", "only data: URLs"),
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
    ("data:image/png,rawtext", "not base64"),
    ("data:image/png;base64,@@@@", "invalid base64"),
    (42, "got int"),
])
def test_bad_items_are_named(proc, payload, message):
    with pytest.raises(ValueError, match=rf"images\[1\]: .*{message}"):
        proc.process("<image> and <image>", [random_images(1)[0], payload])


def test_formats_outside_the_allowed_set_are_not_opened():
    tiff = _encoded(random_images(1)[0], "TIFF")
    assert decode_image(tiff, ImageLimits(formats=("TIFF",))).size == (40, 24)
    with pytest.raises(ValueError, match="not a decodable image"):
        decode_image(tiff, ImageLimits())


def test_unknown_format_name_is_refused():
    with pytest.raises(ValueError, match="cannot open format.*NOPE"):
        ImageLimits(formats=("PNG", "NOPE"))


def test_first_frame_of_an_animation():
    frames = random_images(4)[:2]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=[frames[1].resize(frames[0].size)])
    image = decode_image(buf.getvalue(), ImageLimits())
    assert image.tell() == 0 and image.size == frames[0].size


# --- splicing a chunk -----------------------------------------------------------------------------


def test_embeddings_in_span_cuts_images_anywhere():
    ranges = [PlaceholderRange(2, 3), PlaceholderRange(5, 2), PlaceholderRange(9, 1)]
    embeds = [torch.full((r.length, 4), float(i)) + torch.arange(r.length)[:, None] / 10 for i, r in enumerate(ranges)]
    whole = torch.zeros(12, 4)
    for r, e in zip(ranges, embeds):
        whole[r.offset : r.end] = e
    is_image = torch.zeros(12, dtype=torch.bool)
    for r in ranges:
        is_image[r.offset : r.end] = True
    for start in range(12):
        for n in range(1, 13 - start):
            got = embeddings_in_span(ranges, embeds, start, n)
            want_rows = torch.nonzero(is_image[start : start + n]).flatten()
            if got is None:
                assert want_rows.numel() == 0
                continue
            rows, values = got
            assert torch.equal(rows, want_rows) and torch.equal(values, whole[start + rows])


def test_embeddings_in_span_checks_counts():
    with pytest.raises(ValueError, match="2 embeddings for 3 placeholders"):
        embeddings_in_span([PlaceholderRange(0, 3)], [torch.zeros(2, 4)], 0, 3)


def test_locate_placeholders_takes_either_form(proc):
    image = proc.image_token_id
    counts = [3, 2]
    user = [7, image, 8, image, image][:4] + [9]  # one placeholder per image
    expanded, ranges = locate_placeholders(user, image, counts)
    assert expanded == [7, image, image, image, 8, image, image, 9]
    assert [(r.offset, r.length) for r in ranges] == [(1, 3), (5, 2)]
    assert locate_placeholders(expanded, image, counts) == (expanded, ranges)  # already expanded: the same
    back_to_back = [image] * 5 + [1]  # two images in one run
    assert [(r.offset, r.length) for r in locate_placeholders(back_to_back, image, counts)[1]] == [(0, 3), (3, 2)]
    for bad in ([image, 1, image, image, image, image], [image] * 4, [1, 2]):
        with pytest.raises(ValueError, match="image"):
            locate_placeholders(bad, image, counts)
