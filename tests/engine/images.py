"""Images for the multimodal tests."""

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
