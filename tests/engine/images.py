"""Images and prompts for the multimodal tests."""

from __future__ import annotations

import numpy as np
from PIL import Image


def random_images(count: int, seed: int = 0) -> list[Image.Image]:
    """Noise images of different sizes and modes, so resizing, cropping and RGB conversion all take part."""
    rs = np.random.RandomState(seed)
    images = []
    for i in range(count):
        h, w = 24 + 11 * i, 40 + 7 * (i % 3)
        pixels = rs.randint(0, 256, (h, w, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
        images.append(image.convert(("RGB", "RGBA", "L", "P")[i % 4]))
    return images


# One case per placement of images in a prompt (the parity tests' set).
PROMPTS = {
    "one": "<|user|>\nWhat is in <image> this picture?<|eos|>\n<|assistant|>\n",
    "two": "first <image> and then <image>, compare them.",
    "back_to_back": "These: <image><image> are",
    "at_start": "<image> a photo of",
    "text_only": "the quick brown fox jumps over",
}


def case(name: str, seed: int = 0) -> tuple[str, list[Image.Image]]:
    """A prompt of PROMPTS and as many images as it has placeholders."""
    text = PROMPTS[name]
    return text, random_images(text.count("<image>"), seed=seed)


def mm(text: str, images) -> dict:
    """The LLM API's multimodal prompt."""
    return {"prompt": text, "multi_modal_data": {"image": images}}
