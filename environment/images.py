"""Images in an environment's messages: what an env may return, and how it travels.

An env (environment/base_game.py) returns images from `get_initial_images()` (shown
with the first user message) and in `StepResult.images` (shown with an observation).
An image is a `PIL.Image.Image`, the bytes of an image file, or a `str`/`pathlib.Path`
naming an image file. The envhost turns each into PNG or JPEG file bytes with
`check_images` (the form `EnvResetReply.images` / `EnvStepReply.images` carry), and a
reader turns those back into a picture with `decode_image`.

Pillow is imported only when an image is handled, so envs without images do not need it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

#: images one message may carry
MAX_IMAGES = 8
#: encoded size of one image, bytes (2 MiB)
MAX_IMAGE_BYTES = 2 * 1024 * 1024
#: width * height of one image
MAX_IMAGE_PIXELS = 4096 * 4096

# formats that travel as they are; anything else Pillow reads is re-encoded to PNG
_PASS_THROUGH = ("PNG", "JPEG")
# modes Pillow writes to PNG as they are
_PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16")


def _check_pixels(size: tuple[int, int]) -> None:
    w, h = size
    if w * h > MAX_IMAGE_PIXELS:
        raise ValueError(f"{w}x{h} = {w * h} pixels is over the limit of {MAX_IMAGE_PIXELS} "
                         f"(MAX_IMAGE_PIXELS)")
    if w < 1 or h < 1:
        raise ValueError(f"{w}x{h}: an image needs at least one pixel")


def _open(data: bytes):
    """The decoded picture in `data` and its file format ("PNG", "GIF", ...).
    Raises ValueError when Pillow cannot read it or it has too many pixels."""
    from PIL import Image

    bad = (OSError, SyntaxError, EOFError, ValueError, Image.DecompressionBombError)
    try:
        img = Image.open(io.BytesIO(data))
    except bad as e:
        raise ValueError(f"not a readable image file ({len(data)} bytes: {e})") from None
    _check_pixels(img.size)  # from the header, before the pixels are decoded
    fmt = img.format
    try:
        img.load()  # a truncated or corrupt file fails here, not in the reader
    except bad as e:
        raise ValueError(f"a {fmt} file that does not decode ({len(data)} bytes: {e})") from None
    return img, fmt


def _png(img) -> bytes:
    if img.mode not in _PNG_MODES:  # e.g. CMYK, YCbCr, F
        img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def encode_image(img: Any) -> bytes:
    """One image as PNG or JPEG file bytes.

    `img`: a `PIL.Image.Image` (written as PNG), bytes of an image file, or a str /
    Path naming one (PNG and JPEG pass through unchanged once Pillow has decoded them;
    other formats Pillow reads, e.g. GIF, BMP, WebP, are re-encoded to PNG).

    Raises ValueError for an unreadable file, an image over MAX_IMAGE_PIXELS, or a
    value of another type; FileNotFoundError for a path that does not exist.
    """
    from PIL import Image

    if isinstance(img, Image.Image):
        _check_pixels(img.size)
        return _png(img)
    if isinstance(img, (str, Path)):
        data = Path(img).read_bytes()
    elif isinstance(img, (bytes, bytearray, memoryview)):
        data = bytes(img)
    else:
        raise ValueError(f"an image is a PIL.Image.Image, bytes or a file path, got {type(img).__name__}")
    decoded, fmt = _open(data)
    return data if fmt in _PASS_THROUGH else _png(decoded)


def check_images(images: Any) -> list[bytes]:
    """An env's images for one message, as PNG or JPEG file bytes in the same order.

    `images`: a list (or tuple) of at most MAX_IMAGES images, each as `encode_image`
    takes it; None or empty gives []. Each image, encoded, is at most MAX_IMAGE_BYTES
    and MAX_IMAGE_PIXELS.

    Raises ValueError naming the image ("images[2]: ...") and the limit or problem;
    FileNotFoundError (from a path) likewise names the image.
    """
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"images: must be a list of images, got {type(images).__name__}")
    if len(images) > MAX_IMAGES:
        raise ValueError(f"images: {len(images)} images in one message is over the limit of "
                         f"{MAX_IMAGES} (MAX_IMAGES)")
    out = []
    for i, img in enumerate(images):
        try:
            data = encode_image(img)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"images[{i}]: {e}") from None
        except ValueError as e:
            raise ValueError(f"images[{i}]: {e}") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"images[{i}]: {len(data)} bytes encoded is over the limit of "
                             f"{MAX_IMAGE_BYTES} (MAX_IMAGE_BYTES)")
        out.append(data)
    return out


def decode_image(data: bytes):
    """The picture in image file bytes (e.g. from `EnvResetReply.images`), as an RGB
    `PIL.Image.Image`. Raises ValueError when the bytes are not a readable image or it
    has more than MAX_IMAGE_PIXELS pixels."""
    img, _ = _open(bytes(data))
    return img.convert("RGB")
