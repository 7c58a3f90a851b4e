"""Turn one ``(image, target)`` item of a torchvision-style dataset into shard fields.

Encoded files (bytes or a path) keep their bytes; in-memory images (PIL, uint8 arrays,
CxHxW tensors) are encoded once, in the chosen format. Classification targets follow
WebDataset's conventions: ``cls`` (ASCII digits), ``txt`` (UTF-8), ``json`` (a dict); any
other sample (detection, masks, captions, flow, a dict of fields) follows the field rule of
``remote_loader.format.fields``.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from remote_loader.checks import one_line
from remote_loader.errors import ConfigError, UploadError
from remote_loader.format import fields
from remote_loader.format.images import png_cut_short, structure_problem
from remote_loader.format.index import MAX_FIELD_NAME
from remote_loader.format.video import video_extension
from remote_loader.frames import decode_frames, encode_frames
from remote_loader.upload.originals import Originals

# Pillow's format name -> the field (file extension) it is stored under.
EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff",
              "PPM": "ppm"}
ENCODINGS = {"jpeg": "JPEG", "jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


FRAMES_AS_VIDEO = ("h264", "lossless")


@dataclass(frozen=True)
class EncodeOptions:
    """How in-memory images, and frames, are encoded.

    Attributes:
        image_format: ``"jpeg"``, ``"png"`` or ``"webp"``.
        quality: 1..100, for JPEG and WebP.
        frames_as_video: ``"h264"`` or ``"lossless"``: frames (uint8 ``T x H x W x C`` or
            ``T x C x H x W`` arrays and tensors, C 1 or 3; torchvision ``Video``s) stored as an
            H.264 video (``frames.encode_frames``); None stores their values (``.npy``).
    """

    image_format: str = "jpeg"
    quality: int = 90
    frames_as_video: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.image_format, str) or self.image_format.lower() not in ENCODINGS:
            raise ConfigError(f"image_format must be one of jpeg, png, webp; got {self.image_format!r}")
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"quality must be in 1..100, got {self.quality}")
        if self.frames_as_video is not None and self.frames_as_video not in FRAMES_AS_VIDEO:
            raise ConfigError(f"frames_as_video must be one of {', '.join(FRAMES_AS_VIDEO)} or None, got"
                              f" {self.frames_as_video!r}")


def _fail(index: int, message: str) -> UploadError:
    return UploadError(f"sample {index}: {message}", index=index)


def _sniff(data: bytes, index: int, what: str) -> str:
    """Return the field name for encoded image ``data`` by reading its header; a video
    file's bytes (mp4, mov, mkv, webm, avi) are named by their container. A JPEG or PNG cut
    short is refused."""
    video = video_extension(data)
    if video is not None:
        return video
    fmt = _image_format(data, index, what)
    _check_whole(data, fmt, index, what)
    return EXTENSIONS[fmt]


def _image_format(data: bytes, index: int, what: str) -> str:
    """Pillow's name for the format of image ``data``, one the upload stores; else the
    UploadError naming sample ``index`` and ``what``."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format
    except (UnidentifiedImageError, OSError, ValueError):
        raise _fail(index, f"{what} is not an image Pillow can read, nor a video file (mp4, mov, mkv, webm,"
                           " avi)") from None
    except Image.DecompressionBombError as exc:
        raise _fail(index, f"{what} is larger than Pillow's MAX_IMAGE_PIXELS allows ({one_line(exc)})") from None
    if fmt not in EXTENSIONS:
        raise _fail(index, f"{what} is a {fmt} image; supported: {', '.join(sorted(set(EXTENSIONS)))}")
    return fmt


def _check_whole(data: bytes, fmt: str, index: int, what: str) -> None:
    """The UploadError naming sample ``index`` and ``what`` for a JPEG or PNG cut short, which
    every read would fail to decode."""
    problem = _cut_short(data, fmt)
    if problem is not None:
        raise _fail(index, f"{what} is not a whole {fmt}: {problem} (as a file cut short by a failed copy or"
                           " download), which decoders refuse")


def check_image(data: bytes, index: int, what: str) -> bytes:
    """``data`` where it is a whole image of a format the upload stores; else the UploadError
    that names sample ``index`` and ``what`` (``on_error="skip"`` skips it)."""
    if video_extension(data) is not None:
        raise _fail(index, f"{what} is a video file, not an image")
    _sniff(data, index, what)
    return data


def _cut_short(data: bytes, fmt: str) -> str | None:
    """What makes a JPEG or PNG less than whole (``format.images``), or None; other formats
    are not looked at."""
    if fmt in ("JPEG", "MPO"):
        return structure_problem(data)
    if fmt == "PNG" and png_cut_short(data):
        return "it ends inside its data"
    return None


def _to_pil(array: np.ndarray, index: int) -> Image.Image:
    if array.dtype != np.uint8:
        raise _fail(index, f"image array has dtype {array.dtype}; convert to uint8 (0..255) first")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4)):
        return Image.fromarray(np.ascontiguousarray(array))
    raise _fail(index, f"image array has shape {array.shape}; expected HxW or HxWxC with C in 1, 3, 4")


def _from_tensor(tensor: Any, index: int) -> Image.Image:
    array = np.asarray(tensor.detach().cpu())
    if array.ndim == 3 and array.shape[0] in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # CxHxW -> HxWxC
    return _to_pil(array, index)


HOLDS = {"JPEG": frozenset({"L", "RGB", "CMYK"}),
         "PNG": frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I;16"}),
         "WEBP": frozenset({"RGB"})}
"""The modes each ``image_format`` gives back as they went in (JPEG's pixels close, not
equal). JPEG gives a ``1`` image back as ``L``, a ``P`` one as ``RGB`` without its palette, a
``YCbCr`` one as ``RGB``; WebP an opaque RGBA image as RGB, so it takes RGB only. An image in
another mode is stored lossless, in PNG or TIFF."""


def _encode_pil(image: Image.Image, options: EncodeOptions, index: int, where: str = "image") -> tuple[str, bytes]:
    _not_empty(image, index, where)
    fmt = ENCODINGS[options.image_format.lower()]
    if image.mode not in HOLDS[fmt]:
        return _lossless(image, index, where)
    out = io.BytesIO()
    try:
        image.save(out, format=fmt, quality=options.quality)
    except (OSError, ValueError, KeyError) as exc:
        raise _fail(index, f"{where}: cannot encode a {image.mode} image as {fmt} ({one_line(exc)}); convert it or"
                           " pick another image_format") from None
    return EXTENSIONS[fmt], out.getvalue()


def _lossless(image: Image.Image, index: int, where: str) -> tuple[str, bytes]:
    """``image`` in PNG, or TIFF for the modes PNG does not hold (CMYK, LAB, YCbCr, I, F)."""
    _not_empty(image, index, where)
    fmt = "PNG" if image.mode in HOLDS["PNG"] else "TIFF"
    out = io.BytesIO()
    try:
        image.save(out, format=fmt)
    except (OSError, ValueError, KeyError):
        raise _fail(index, f"{where} is a {image.mode} image, which no image format stores; convert it (to RGB, for"
                           " one)") from None
    return EXTENSIONS[fmt], out.getvalue()


def _not_empty(image: Image.Image, index: int, where: str) -> None:
    """The UploadError naming sample ``index`` and ``where`` for an image of no pixels (a crop
    of nothing), which every format refuses (WebP's encoder with a bare MemoryError)."""
    if 0 in image.size:
        raise _fail(index, f"{where} is an empty image ({image.width} x {image.height}): no image format stores"
                           " one")


def encode_image(image: Any, options: EncodeOptions, index: int,
                 originals: Originals | None = None) -> tuple[str, bytes]:
    """Return ``(field, bytes)`` for an image given as bytes, a path, PIL, array or tensor; a
    PIL image that is exactly one of ``originals`` (the files its item was read from) as that
    file's bytes."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        return _sniff(data, index, "image bytes"), data
    if isinstance(image, (str, os.PathLike)):
        data = _read_file(os.fspath(image), index)
        return _sniff(data, index, repr(os.fspath(image))), data
    if isinstance(image, Image.Image):
        kept = originals.match(image) if originals is not None else None
        return kept if kept is not None else _encode_pil(image, options, index)
    if isinstance(image, np.ndarray):
        return _encode_pil(_to_pil(plain_array(image, index, "image"), index), options, index)
    if type(image).__module__.startswith("torch") and hasattr(image, "detach"):
        return _encode_pil(_from_tensor(image, index), options, index)
    raise _fail(index, f"image is a {type(image).__name__}; expected PIL image, uint8 array, tensor, bytes or path")


_NOT_FILES = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
              (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a folder"))


def _read_file(path: str, index: int) -> bytes:
    """The bytes of the file ``path``; UploadError naming sample ``index`` for what cannot be
    read, or is no file: a named pipe was opened and read, which waits for ever for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise _fail(index, f"cannot read {path!r}: {exc.strerror}") from None
    with open(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        what = next((name for test, name in _NOT_FILES if test(mode)), None)
        if what is not None:
            raise _fail(index, f"{path!r} is {what}, not a file")
        try:
            return f.read()
        except OSError as exc:
            raise _fail(index, f"cannot read {path!r}: {exc.strerror}") from None


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _plain(value: Any, index: int, where: str) -> int | float | str:
    """A classification target's value (an int subclass as the int it is); a tensor (even
    of one value) is not one: it is stored as a tensor, by the field rule, and comes back a
    tensor."""
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(index, f"{where} is a {type(value).__name__}; expected int, float or str")
    if isinstance(value, int):  # an IntEnum (on Python 3.10) or any int subclass: its str() need not be digits
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(index, f"{where} is {value}; JSON targets must be finite")
    return value


def encode_target(target: Any, index: int) -> dict[str, bytes]:
    """Return the label fields for a classification target: ``cls``, ``txt`` or ``json`` (none for None)."""
    if target is None:
        return {}
    if isinstance(target, Mapping):
        plain = {}
        for name, value in target.items():
            if not isinstance(name, str):
                raise _fail(index, f"target dict key {name!r} is not a str")
            plain[name] = _plain(value, index, f"target[{name!r}]")
        return {"json": json.dumps(plain, sort_keys=True, ensure_ascii=False).encode()}
    value = _plain(target, index, "target")
    if isinstance(value, float):
        raise _fail(index, "target is a float; use an int class index, a str or a dict")
    if isinstance(value, int):
        return {"cls": str(value).encode("ascii")}  # an int by now (_plain)
    return {"txt": value.encode("utf-8")}


def encode_item(item: Any, options: EncodeOptions, index: int, originals: Originals | None = None) -> dict[str, bytes]:
    """Return the fields of ``ds[index]``: a classification pair under WebDataset's names,
    any other tuple or a dict by the field rule (``remote_loader.format.fields``); its PIL
    images that are exactly one of ``originals`` as that file's bytes.
    UploadError for a sample with no field, or a field name longer than a shard holds."""
    try:
        fields = _fields(item, options, index, originals)
    except UnicodeEncodeError as exc:  # a str with a lone surrogate: a file name decoded with surrogateescape
        raise _fail(index, f"a str of ds[{index}] is not UTF-8 text ({exc.reason}: {exc.object[exc.start:exc.end]!r}"
                           f" at position {exc.start} of {exc.object[:40]!r})") from None
    if not fields:
        raise _fail(index, f"ds[{index}] is an empty {type(item).__name__}: a sample has at least one field")
    for name in fields:
        if len(name) > MAX_FIELD_NAME:
            raise _fail(index, f"field {name[:24]!r}... is {len(name)} characters long, more than a shard's"
                               f" {MAX_FIELD_NAME}:"
                               " shorten its key")
    return fields


def _fields(item: Any, options: EncodeOptions, index: int, originals: Originals | None) -> dict[str, bytes]:
    if isinstance(item, Mapping):
        return Structured(options, index, originals).sample(item)
    if not isinstance(item, (tuple, list)) or not item:
        raise _fail(index, f"ds[{index}] returned a {type(item).__name__}; expected an (image, target) pair,"
                           " a tuple or a dict of fields")
    if len(item) == 2 and not _values_not_pixels(item[0]):
        try:  # a classification target (None, int, str, a flat dict of scalars): WebDataset's names, as always
            target = encode_target(item[1], index)
        except UploadError:
            target = None
        if target is not None:
            field, data = encode_image(item[0], options, index, originals)
            return {field: data, **target}
    return Structured(options, index, originals).sample(item)


def _values_not_pixels(value: Any) -> bool:
    """An array or tensor of other than uint8 where a pair's image goes: ``ToTensor``'s floats
    in [0, 1], or normalised ones; or of more than 3 dimensions (a clip's frames); or a
    tv_tensor (``v2.ToImage``'s ``Image``), which comes back as that class. No image
    format holds them as they are, and turning them into 8-bit pixels would alter them: the
    pair is stored by the field rule, the array as its values (``.npy``; frames as a video
    with ``frames_as_video``), and comes back as it went in."""
    if isinstance(value, np.ndarray):
        return bool(value.dtype != np.uint8 or value.ndim > 3)
    return _is_tensor(value) and (str(value.dtype) != "torch.uint8" or value.dim() > 3
                                  or tv_placeholder(value) is not None)  # a tv_tensor comes back one


class Structured:
    """One structured sample's fields, by the field rule: each value under its stem, and
    each array, tensor, image or bytes inside a nested value as a member of its own."""

    def __init__(self, options: EncodeOptions, index: int, originals: Originals | None = None) -> None:
        self.options, self.index, self.originals = options, index, originals
        self.fields: dict[str, bytes] = {}

    def sample(self, item: Mapping[Any, Any] | Sequence[Any]) -> dict[str, bytes]:
        try:
            return self._sample(item)
        except RecursionError:  # a list that holds itself, or nesting deeper than the interpreter's stack
            raise _fail(self.index, f"ds[{self.index}] is nested too deep to store (or holds itself)") from None

    def _sample(self, item: Mapping[Any, Any] | Sequence[Any]) -> dict[str, bytes]:
        if isinstance(item, Mapping):
            for key, value in item.items():
                if not isinstance(key, str) or not fields.NAMED.match(key) or key.startswith("__"):
                    raise _fail(self.index, f"field name {key!r} of a dict sample is refused: use letters, digits,"
                                            " '_' and '-', starting with a letter or '_' (not '__')")
                self._top(key, value, f"item[{key!r}]", first=False)
        else:
            names = ("image", "target") if len(item) == 2 else tuple(f"item[{i}]" for i in range(len(item)))
            for i, value in enumerate(item):
                self._top(str(i), value, names[i], first=i == 0)
        return self.fields

    def _add(self, stem: str, steps: tuple[str, ...], ext: str, data: bytes, where: str) -> None:
        bad = [s for s in steps if not fields.STEP.match(s)]
        if bad:
            raise _fail(self.index, f"{where} lies under the key {bad[0]!r}: keys above an array, tensor, image or"
                                    " bytes use letters, digits, '_' and '-' only")
        self.fields[fields.render(stem, steps, ext)] = data

    def _top(self, stem: str, value: Any, where: str, first: bool) -> None:
        if value is None or isinstance(value, (bool, float, np.floating, np.bool_)):
            self.fields[f"{stem}.json"] = _json(self._skeleton(stem, (), value, where))
        elif isinstance(value, (int, np.integer)):
            self.fields[f"{stem}.cls"] = str(int(value)).encode("ascii")
        elif isinstance(value, str) and not first:
            self.fields[f"{stem}.txt"] = value.encode("utf-8")
        elif isinstance(value, (str, os.PathLike)):
            ext, data = encode_image(value, self.options, self.index)
            self.fields[f"{stem}.{ext}"] = data
        elif isinstance(value, (bytes, bytearray, memoryview)):
            ext, data = self._bytes(value, where)
            self.fields[f"{stem}.{ext}"] = data
        elif isinstance(value, Image.Image):
            ext, data = self._image(value, where)
            self.fields[f"{stem}.{ext}"] = data
        elif isinstance(value, np.ndarray) and not self._as_video(plain_array(value, self.index, where)):
            self.fields[f"{stem}.npy"] = _npy(value, self.index, where)
        else:  # a tensor, frames, a list, a tuple, a dict: a skeleton and its members
            self.fields[f"{stem}.json"] = _json(self._skeleton(stem, (), value, where))

    def _skeleton(self, stem: str, steps: tuple[str, ...], value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (np.bool_, np.integer, np.floating)):
            value = value.item()
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _fail(self.index, f"{where} is {value}: JSON holds finite numbers (store it in a numpy array)")
            return value
        if isinstance(value, (list, tuple)):
            return [self._skeleton(stem, (*steps, str(i)), v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            out = {}
            for key, v in value.items():
                if not isinstance(key, str):
                    raise _fail(self.index, f"{where} has the key {key!r}, a {type(key).__name__}: JSON keys are str")
                out[key] = self._skeleton(stem, (*steps, key), v, f"{where}[{key!r}]")
            return out
        if isinstance(value, np.ndarray):
            plain_array(value, self.index, where)
        if self._as_video(value):
            placeholder = self._frames(stem, steps, value, where)
            if placeholder is not None:
                return placeholder
        if isinstance(value, np.ndarray):
            self._add(stem, steps, "npy", _npy(value, self.index, where), where)
            return "numpy"
        if _is_tensor(value):
            self._add(stem, steps, "npy", _npy(_tensor_array(value, self.index, where), self.index, where), where)
            return tv_placeholder(value) or "torch"
        if isinstance(value, Image.Image):
            ext, data = self._image(value, where)
            self._add(stem, steps, ext, data, where)
            return "image"
        if isinstance(value, (bytes, bytearray, memoryview)):
            self._add(stem, steps, "bin", bytes(value), where)
            return "bytes"
        raise _fail(self.index, f"{where} is of type {type(value).__name__}: no field stores it (expected None,"
                                " bool, int, float, str, list, tuple, dict, numpy array, tensor, PIL image or bytes)")

    def _as_video(self, value: Any) -> bool:
        """Whether ``value`` is frames this upload stores as a video."""
        return self.options.frames_as_video is not None and _frames_layout(value) is not None

    def _frames(self, stem: str, steps: tuple[str, ...], value: Any, where: str) -> str | None:
        """Frames stored as an H.264 member (``mp4``); their placeholder says what they were.
        Lossless frames that would not decode to exactly themselves are left to ``.npy``
        (None)."""
        layout = _frames_layout(value)
        array = value if isinstance(value, np.ndarray) else _tensor_array(value, self.index, where)
        frames = array if layout == "THWC" else array.transpose(0, 2, 3, 1)
        channels = int(frames.shape[3])
        rgb = np.ascontiguousarray(np.repeat(frames, 3, axis=3) if channels == 1 else frames)
        lossless = self.options.frames_as_video == "lossless"
        try:
            data = encode_frames(rgb, lossless=lossless)
            if lossless and not np.array_equal(decode_frames(data, *rgb.shape[:3]), rgb):
                return None  # not exactly them: their values
        except ValueError as exc:
            raise _fail(self.index,
                        f"{where}: its frames {array.shape} do not encode as H.264 ({one_line(exc)})") from None
        if len(data) >= array.nbytes:  # noise compresses no better than that: their values are smaller
            return None
        self._add(stem, steps, "mp4", data, where)
        was = "numpy" if isinstance(value, np.ndarray) else tv_placeholder(value) or "torch"
        return fields.frames_placeholder({"layout": layout, "channels": channels, "shape": list(array.shape),
                                          "of": was})

    def _image(self, image: Image.Image, where: str) -> tuple[str, bytes]:
        kept = self.originals.match(image) if self.originals is not None else None
        if kept is not None:
            return kept
        if image.mode in fields.INPUT_MODES:
            return _encode_pil(image, self.options, self.index, where)
        return _lossless(image, self.index, where)

    def _bytes(self, data: bytes | bytearray | memoryview, where: str) -> tuple[str, bytes]:
        """An encoded image's or video's own format, or ``bin`` for bytes Pillow does not
        read; an image's bytes cut short are refused, as every read would fail to decode them."""
        raw = bytes(data)
        video = video_extension(raw)
        if video is not None:
            return video, raw
        try:
            fmt = _image_format(raw, self.index, where)
        except UploadError:
            return "bin", raw
        _check_whole(raw, fmt, self.index, where)
        return EXTENSIONS[fmt], raw


def _frames_layout(value: Any) -> str | None:
    """``"THWC"`` or ``"TCHW"`` where ``value`` is frames (uint8, 4 dimensions, 1 or 3
    channels last, or second: torchvision's ``Video`` always), else None."""
    if isinstance(value, np.ndarray):
        shape, uint8 = value.shape, value.dtype == np.uint8
    elif _is_tensor(value):
        shape, uint8 = tuple(value.shape), str(value.dtype) == "torch.uint8"
    else:
        return None
    if not uint8 or len(shape) != 4 or 0 in shape:
        return None
    if type(value).__name__ == "Video" or (shape[-1] not in (1, 3) and shape[1] in (1, 3)):
        return "TCHW" if shape[1] in (1, 3) else None
    return "THWC" if shape[-1] in (1, 3) else None


NUMERIC_KINDS = frozenset("biuf")


def plain_array(array: np.ndarray, index: int, where: str) -> np.ndarray:
    """``array`` where a shard keeps all it is: a plain ndarray, or an ``np.memmap`` (a file's
    values). Another subclass (a masked array's mask, a matrix's or recarray's class) would
    come back a plain ndarray: the UploadError naming sample ``index`` and ``where``."""
    if type(array) is np.ndarray or isinstance(array, np.memmap):
        return array
    kind = type(array).__name__
    hint = ("its data and np.ma.getmaskarray() of it as two arrays" if isinstance(array, np.ma.MaskedArray)
            else "np.asarray() of it")
    raise _fail(index, f"{where} is a numpy {kind}, which a shard would give back as a plain ndarray without what"
                       f" {kind} adds; store {hint}")


def _npy(array: np.ndarray, index: int, where: str) -> bytes:
    plain_array(array, index, where)
    if array.dtype.kind not in NUMERIC_KINDS:
        raise _fail(index, f"{where} is an array of {array.dtype}: arrays of bool, int, uint or float are stored")
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def tv_placeholder(tensor: Any) -> str | None:
    """The placeholder of a torchvision tv_tensor (its class and metadata), None for a plain tensor."""
    cls = next((c for c in type(tensor).__mro__
                if c.__module__.startswith("torchvision.tv_tensors") and c.__name__ in fields.TV_TENSORS), None)
    if cls is None:
        return None
    meta: dict[str, Any] = {}
    if getattr(tensor, "format", None) is not None:
        meta["format"] = tensor.format.name
    if getattr(tensor, "canvas_size", None) is not None:
        meta["canvas_size"] = [int(v) for v in tensor.canvas_size]
    if hasattr(tensor, "clamping_mode"):
        meta["clamping_mode"] = tensor.clamping_mode
    return fields.tv_placeholder(cls.__name__, meta)


def _tensor_array(tensor: Any, index: int, where: str) -> np.ndarray:
    if tensor.is_complex() or str(tensor.layout) != "torch.strided":
        raise _fail(index, f"{where} is a {tensor.dtype} tensor ({tensor.layout}): dense bool, int, uint or float"
                           " tensors are stored")
    try:
        return tensor.detach().cpu().resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError):  # bfloat16, the float8 dtypes
        raise _fail(index, f"{where} is a {tensor.dtype} tensor, which NumPy does not hold: convert it to float32"
                           " (.float())") from None


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
