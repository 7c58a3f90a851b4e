"""Each sample's digest: recorded in its shard's index (an optional column that older readers
skip and older shards lack), and made of the item's content whatever state its images are in."""

from __future__ import annotations

import io

import msgpack
import numpy as np
import pytest
from PIL import Image

from remote_loader.errors import CorruptShard, UploadError
from remote_loader.format import ShardIndex, ShardWriter
from remote_loader.format.index import DIGEST_SIZE, INDEX_MEMBER
from remote_loader.upload.fingerprint import item_digest, matches
from remote_loader.upload.originals import Originals, read_watching


def _shard(digests):
    out = io.BytesIO()
    writer = ShardWriter(out.write)
    for i, digest in enumerate(digests):
        writer.add(f"{i:06d}", {"cls": str(i).encode()}, digest)
    summary = writer.close()
    data = out.getvalue()
    return ShardIndex.decode(data[summary.index_offset : summary.index_offset + summary.index_size],
                             data_end=summary.index_offset - 512), data, summary


def test_a_shard_records_each_samples_digest_in_its_index():
    digests = [bytes([i]) * DIGEST_SIZE for i in range(3)]
    index, data, summary = _shard(digests)
    assert [index.digest(i) for i in range(3)] == digests
    assert summary.size <= ShardWriter(io.BytesIO().write).projected_size("000000", {"cls": b"0"}) * 3 + 4096
    raw = msgpack.unpackb(data[summary.index_offset : summary.index_offset + summary.index_size])
    assert raw["version"] == 1 and raw["digests"] == b"".join(digests)  # a key older readers do not ask for


def test_a_shard_without_digests_reads_as_before_and_bad_digests_are_refused():
    index, _, summary = _shard([None, None])
    assert index.digests is None and index.digest(0) is None
    raw = msgpack.unpackb(index.encode())
    assert "digests" not in raw
    raw["digests"] = b"short"
    with pytest.raises(CorruptShard, match="digests are not 16 bytes"):
        ShardIndex.decode(msgpack.packb(raw), data_end=summary.index_offset - 512, name="s.tar")


def test_a_shard_has_a_digest_for_every_sample_or_none():
    writer = ShardWriter(io.BytesIO().write)
    writer.add("a", {"cls": b"1"}, b"x" * DIGEST_SIZE)
    with pytest.raises(ValueError, match="a digest each, or none"):
        writer.add("b", {"cls": b"2"})
    with pytest.raises(ValueError, match="a digest is 8 bytes"):
        writer.add("c", {"cls": b"3"}, b"short")
    assert len(writer) == 1 and INDEX_MEMBER not in writer.index().keys


def _digest(read):
    item, originals = read_watching(lambda _: read(), 0)
    return item_digest(item, originals.match, 0)


def test_an_images_digest_is_its_files_whether_or_not_it_was_decoded_first(tmp_path):
    """A file's image hands over undecoded at upload and decoded at a later run (or the other
    way round): the same digest; changed in place, another."""
    path = tmp_path / "a.jpg"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(path)
    undecoded = _digest(lambda: (Image.open(path), 1))
    loaded = Image.open(path)
    loaded.load()
    assert _digest(lambda: (loaded, 1)) == undecoded
    assert _digest(lambda: (Image.open(path).convert("RGB"), 1)) == undecoded  # decoded while read
    assert _digest(lambda: (str(path), 1)) != undecoded  # a path is another item than an image
    assert _digest(lambda: (Image.open(path), 2)) != undecoded
    loaded.putpixel((0, 0), (1, 2, 3))
    assert _digest(lambda: (loaded, 1)) != undecoded


def test_an_item_whose_image_cannot_be_decoded_names_its_sample(tmp_path):
    path = tmp_path / "cut.png"
    Image.new("RGB", (64, 64), (9, 9, 9)).save(path)
    path.write_bytes(path.read_bytes()[:60])
    with Image.open(path) as image, pytest.raises(UploadError, match=r"^sample 7: its content cannot be read"):
        item_digest((image, 1), Originals([]).match, 7)


def _palette(colours, transparency=None, comment=None) -> Image.Image:
    image = Image.fromarray(np.arange(4, dtype=np.uint8).reshape(2, 2) % 2)
    image.putpalette(colours)
    if transparency is not None:
        image.info["transparency"] = transparency
    if comment is not None:
        image.info["comment"] = comment
    return image


def test_what_an_image_format_keeps_beyond_the_pixels_is_in_the_digest():
    """A mask's palette and transparency, an ICC profile, a JPEG's comment come back from the
    round trip: an item that changed only in them is another item."""
    red = _digest(lambda: (_palette([0, 0, 0, 255, 0, 0]), 1))
    assert _digest(lambda: (_palette([0, 0, 0, 255, 0, 0]), 1)) == red
    assert _digest(lambda: (_palette([0, 0, 0, 0, 255, 0]), 1)) != red
    assert _digest(lambda: (_palette([0, 0, 0, 255, 0, 0], transparency=0), 1)) != red
    assert _digest(lambda: (_palette([0, 0, 0, 255, 0, 0], comment=b"x"), 1)) != red
    plain = Image.new("RGB", (4, 4), (1, 2, 3))
    profiled = plain.copy()
    profiled.info["icc_profile"] = b"a profile"
    assert _digest(lambda: (profiled, 1)) != _digest(lambda: (plain, 1))
    assert item_digest(profiled, Originals([]).match, 0) != item_digest(plain, Originals([]).match, 0)


def test_a_tv_tensors_metadata_is_in_the_digest():
    torch = pytest.importorskip("torch")
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")

    def boxes(fmt, canvas):
        return tv_tensors.BoundingBoxes(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), format=fmt, canvas_size=canvas)

    xyxy = _digest(lambda: (Image.new("L", (8, 8)), {"boxes": boxes("XYXY", (8, 8))}))
    assert _digest(lambda: (Image.new("L", (8, 8)), {"boxes": boxes("XYXY", (8, 8))})) == xyxy
    assert _digest(lambda: (Image.new("L", (8, 8)), {"boxes": boxes("XYWH", (8, 8))})) != xyxy
    assert _digest(lambda: (Image.new("L", (8, 8)), {"boxes": boxes("XYXY", (100, 200))})) != xyxy
    plain = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert item_digest(plain, Originals([]).match, 0) == item_digest(plain.clone(), Originals([]).match, 0)


def test_a_digest_recorded_before_palettes_were_hashed_still_matches_its_item():
    """A dataset uploaded when digests held pixels alone is still kept by a run over its items:
    the digest of the same rule without what lies beside the pixels matches it."""
    item = (_palette([0, 0, 0, 255, 0, 0]), 1)
    recorded_then = item_digest(item, Originals([]).match, 0, beside=False)
    assert recorded_then != item_digest(item, Originals([]).match, 0)
    assert matches(recorded_then, item, Originals([]).match, 0)
    assert matches(item_digest(item, Originals([]).match, 0), item, Originals([]).match, 0)
    recolored = (_palette([0, 0, 0, 0, 255, 0]), 1)
    assert not matches(item_digest(item, Originals([]).match, 0), recolored, Originals([]).match, 0)
    assert not matches(recorded_then, (_palette([0, 0, 0, 255, 0, 0]).transpose(Image.Transpose.FLIP_LEFT_RIGHT), 1),
                       Originals([]).match, 0)
