"""Image preprocessing shared by training and serving: bytes in, a normalised tensor out.

:func:`preprocess` is the one function both sides call, so a served model sees exactly the
pixels it was trained on: decode with Pillow (PNG, JPEG, WebP, GIF's first frame; nothing else),
convert to RGB, resize to ``size`` x ``size`` (bicubic), scale to [0, 1] and normalise per
channel with the stored mean and std (:class:`ImageSpec`, kept in the export's
``preprocessor_config.json``). Every refusal is an :class:`ImageError` whose message says what
was wrong; callers prefix it with the item it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from forge_kit.images import MAX_IMAGE_PIXELS as MAX_PIXELS
from forge_kit.images import ImageError, open_image

#: Largest encoded image accepted in a shard (bytes).
MAX_BYTES = 8 * 1024 * 1024
#: CLIP's normalisation, the default of a new vision tower.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageSpec:
    """What :func:`preprocess` does: the square side and the per-channel mean and std."""

    size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def preprocessor_config(self) -> dict[str, object]:
        """The Hugging Face ``CLIPImageProcessor`` settings that do the same (no crop)."""
        return {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"height": self.size, "width": self.size},
            "resample": int(Image.Resampling.BICUBIC),
            "do_center_crop": False,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(self.mean),
            "image_std": list(self.std),
            "do_convert_rgb": True,
        }

    @classmethod
    def from_preprocessor_config(cls, data: dict[str, object]) -> ImageSpec:
        size = data.get("size")
        if not isinstance(size, dict) or size.get("height") != size.get("width"):
            raise ImageError(f"preprocessor_config: size must be a square {{height, width}}, got {size!r}")
        mean, std = data.get("image_mean"), data.get("image_std")
        if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == 3):
            raise ImageError("preprocessor_config: image_mean and image_std must be lists of 3")
        return cls(int(size["height"]), (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))


def decode(data: bytes, max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The RGB image in ``data``; :class:`ImageError` if it is empty, over ``max_bytes``, of a
    format not in :data:`FORMATS`, over ``max_pixels``, or corrupt. The decoding and its checks are
    the kit's (:func:`forge_kit.images.open_image`, what the model server runs on a request's
    image), so training and serving refuse the same images."""
    if not data:
        raise ImageError("empty image")
    if len(data) > max_bytes:
        raise ImageError(f"image of {len(data)} bytes is over the {max_bytes}-byte limit")
    try:
        image: Image.Image = open_image(data, max_pixels=max_pixels)
    except ImageError as exc:
        raise ImageError(f"image {exc}") from None
    return image


def preprocess(data: bytes | Image.Image, spec: ImageSpec) -> torch.Tensor:
    """``[3, size, size]`` float32: decoded (when bytes), RGB, resized (bicubic), scaled to
    [0, 1], normalised with ``spec``'s mean and std. Deterministic."""
    image = decode(data) if isinstance(data, bytes) else data.convert("RGB")
    if image.size != (spec.size, spec.size):
        image = image.resize((spec.size, spec.size), Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.float32) / 255.0
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    return torch.from_numpy(((array - mean) / std).transpose(2, 0, 1).copy())


def preprocess_many(images: list[bytes], spec: ImageSpec) -> torch.Tensor:
    """``[n, 3, size, size]`` of :func:`preprocess` (``[0, 3, size, size]`` for none)."""
    if not images:
        return torch.zeros(0, 3, spec.size, spec.size)
    return torch.stack([preprocess(b, spec) for b in images])
