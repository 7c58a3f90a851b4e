"""Cropping and resizing a batch of decoded images of many sizes in a few kernels: each
image's crop window gathered into one padded batch, then resized by two batched matrix
products with antialiased bilinear weights (as ``interpolate(..., antialias=True)``), the
flip folded into them. Shapes come from the host; nothing is read back from the device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

PIXELS = 1 << 24
"""Padded pixels resized at once (``images x tallest window x widest window``): about
0.5 GB of GPU memory for the gather and the float32 batch, whatever the images' sizes."""


def chunks(windows: Sequence[tuple[int, int]], budget: int = PIXELS) -> list[range]:
    """Consecutive runs of windows ``(height, width)`` whose padded batch stays within
    ``budget`` pixels; a window larger than that alone."""
    out: list[range] = []
    first, tall, wide = 0, 0, 0
    for k, (h, w) in enumerate(windows):
        t, v = max(tall, h), max(wide, w)
        if k > first and (k - first + 1) * t * v > budget:
            out.append(range(first, k))
            first, t, v = k, h, w
        tall, wide = t, v
    if windows:
        out.append(range(first, len(windows)))
    return out


def weights(starts: torch.Tensor, lengths: torch.Tensor, padded: int, size: int, flips: torch.Tensor | None,
            device: torch.device) -> torch.Tensor:
    """``(n, size, padded)`` antialiased bilinear weights resizing each image's ``lengths[k]``
    pixels (from ``starts[k]`` of its padded row, both may be fractions) to ``size``, as
    torch's ``interpolate(..., antialias=True)`` does, flipped where ``flips`` says."""
    scale = (lengths / size)[:, None, None]
    support = torch.clamp(scale, min=1.0)  # a triangle as wide as the scale when shrinking
    centre = scale * (torch.arange(size, device=device, dtype=torch.float64)[None, :, None] + 0.5)
    source = torch.arange(padded, device=device, dtype=torch.float64)[None, None, :] - starts[:, None, None]
    weight = torch.clamp(1 - torch.abs(source + 0.5 - centre) / support, min=0)
    weight = weight * ((source >= 0) & (source < lengths[:, None, None]))
    weight = weight / weight.sum(-1, keepdim=True).clamp(min=1e-12)
    if flips is not None:
        weight = torch.where(flips[:, None, None], weight.flip(1), weight)
    return weight.to(torch.float32)


def resize(images: Sequence[torch.Tensor], boxes: Sequence[tuple[float, float, float, float]],
           flips: Sequence[bool], size: int, device: torch.device) -> torch.Tensor:
    """Each ``3 x h x w`` uint8 image's ``box`` (left, top, right, bottom) resized to
    ``size x size`` and flipped where asked: ``n x 3 x size x size`` float32, unrounded."""
    shapes = np.array([image.shape[1:] for image in images], dtype=np.int64).reshape(-1, 2)
    box = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    h, w = shapes[:, 0], shapes[:, 1]
    x0 = np.minimum(box[:, 0].astype(np.int64), w - 1)
    y0 = np.minimum(box[:, 1].astype(np.int64), h - 1)
    x1 = np.maximum(x0 + 1, np.minimum(w, np.ceil(box[:, 2]).astype(np.int64)))
    y1 = np.maximum(y0 + 1, np.minimum(h, np.ceil(box[:, 3]).astype(np.int64)))
    # per image: where its window starts in the image and how large it is, then the box
    # within the window (start and length, fractions where the box's edges are)
    ints = np.stack([h, w, y0, x0, y1 - y0, x1 - x0], axis=1)
    spans = np.stack([box[:, 1] - y0, box[:, 3] - box[:, 1], box[:, 0] - x0, box[:, 2] - box[:, 0]], axis=1)
    flipped = np.asarray(flips, dtype=bool)
    out = [_resize_chunk([images[k] for k in part], ints[part.start : part.stop], spans[part.start : part.stop],
                         flipped[part.start : part.stop], size, device)
           for part in chunks(list(zip((y1 - y0).tolist(), (x1 - x0).tolist(), strict=True)))]
    return torch.cat(out) if len(out) != 1 else out[0]


def _resize_chunk(images: list[torch.Tensor], ints: np.ndarray, spans: np.ndarray, flips: np.ndarray, size: int,
                  device: torch.device) -> torch.Tensor:
    tall, wide = int(ints[:, 4].max()), int(ints[:, 5].max())
    flat = torch.cat([image.reshape(-1) for image in images])  # one kernel, wherever each image lies
    planes = ints[:, 0] * ints[:, 1]
    offsets = np.concatenate(([0], np.cumsum(3 * planes)[:-1]))
    host = torch.from_numpy(np.concatenate([offsets[:, None], planes[:, None], ints], axis=1))
    on = _to(host, device)
    offset, plane, _, width, y0, x0, wh, ww = on.unbind(1)
    ys = y0[:, None] + torch.minimum(torch.arange(tall, device=device)[None, :], (wh - 1)[:, None])
    xs = x0[:, None] + torch.minimum(torch.arange(wide, device=device)[None, :], (ww - 1)[:, None])
    at = offset[:, None, None] + ys[:, :, None] * width[:, None, None] + xs[:, None, :]
    padded = torch.stack([flat[at + c * plane[:, None, None]] for c in range(3)], dim=1).float()
    box = _to(torch.from_numpy(spans), device)
    rows = weights(box[:, 0], box[:, 1], tall, size, None, device)
    columns = weights(box[:, 2], box[:, 3], wide, size, _to(torch.from_numpy(flips), device), device)
    return rows[:, None] @ padded @ columns[:, None].transpose(-1, -2)


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without blocking the host (pinned, then copied on
    the current stream)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
