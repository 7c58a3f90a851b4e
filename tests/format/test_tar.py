"""Scanning tars written by other tools: what tarfile (and so WebDataset) reads, or a refusal
naming the tar and the member; never a silently different sample."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from remote_loader.errors import CorruptShard
from remote_loader.format import ShardWriter
from remote_loader.format.index import ShardIndex
from remote_loader.format.tar import scan_tar

SPARSE = "a sparse file (tar --sparse): its bytes are not stored in one piece and cannot be indexed in place"


def scan(data: bytes, name: str = "s.tar") -> ShardIndex:
    return scan_tar(lambda start, end: memoryview(data)[start:end], name, len(data))[0]


def tar_of(*members: tuple[str | tarfile.TarInfo, bytes], **options: object) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, **options) as tar:  # type: ignore[call-overload]
        for member, data in members:
            info = member if isinstance(member, tarfile.TarInfo) else tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def pax(name: str, data: bytes, **records: str) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.pax_headers = records
    return info, data


def record(keyword: str, value: bytes) -> bytes:
    """One pax record, ``"<length> keyword=value\\n"``, its length counting itself."""
    body = b" " + keyword.encode() + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def block_padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def raw_tar(*parts: tuple[str, bytes, bytes]) -> bytes:
    """A tar of ``(name, type, data)`` members as they are, extended headers included."""
    return b"".join(header(name, len(data), kind) + block_padded(data) for name, kind, data in parts) + bytes(1024)


def tarfile_reads(data: bytes) -> dict[tuple[str, str], tuple[int, int]]:
    """``(key, field) -> (offset, size)`` of every member as tarfile reads it, the field
    lower-cased as WebDataset's ``group_by_keys`` does."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.isreg()]
    return {(m.name.partition(".")[0], m.name.partition(".")[2].lower()): (m.offset_data, m.size) for m in members}


def indexed(index: ShardIndex) -> dict[tuple[str, str], tuple[int, int]]:
    return {(key, field): (offset, size) for i, key in enumerate(index.keys)
            for field, offset, size, _ in index.members(i)}


# --------------------------------------------------------------------------- sparse members


@pytest.mark.parametrize("records", [
    {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "a.bin", "GNU.sparse.realsize": "4096"},
    {"GNU.sparse.map": "0,5,4091,5", "GNU.sparse.size": "4096", "GNU.sparse.numblocks": "2"},
], ids=["pax 1.0", "pax 0.1"])
def test_a_pax_sparse_member_is_refused_naming_the_tar_and_member(records):
    name = "./GNUSparseFile.7/a.bin" if "GNU.sparse.name" in records else "a.bin"
    data = tar_of(("0.jpg", b"first"), pax(name, b"1\n0\n5\n".ljust(512, b"\0") + b"HEAD!", **records),
                  ("c.txt", b"after"))
    with pytest.raises(CorruptShard, match=re.escape(f"s.tar: member 'a.bin' is {SPARSE}")) as caught:
        scan(data)
    assert caught.value.name == "s.tar"


def _sparse_tar(tmp_path: Path, tar_format: list[str]) -> bytes:
    if shutil.which("tar") is None or b"GNU" not in subprocess.run(["tar", "--version"], capture_output=True).stdout:
        pytest.skip("GNU tar is not installed")
    folder = tmp_path / "files"
    folder.mkdir()
    with open(folder / "b.bin", "wb") as file:  # eight data segments: more than a GNU header holds (4)
        for i in range(8):
            file.seek(i << 16)
            file.write(bytes([65 + i]) * 1000)
        file.truncate(9 << 16)
    (folder / "c.txt").write_bytes(b"after")
    out = tmp_path / "s.tar"
    subprocess.run(["tar", "--sparse", *tar_format, "-C", str(folder), "-cf", str(out), "b.bin", "c.txt"], check=True)
    with tarfile.open(out) as tar:
        if not tar.getmember("b.bin").issparse():
            pytest.skip(f"{tmp_path} makes no holes in files: tar stored b.bin whole")
    return out.read_bytes()


@pytest.mark.parametrize("tar_format", [["--format=gnu"], ["--format=posix", "--sparse-version=1.0"]],
                         ids=["gnu", "pax 1.0"])
def test_a_sparse_member_written_by_gnu_tar_is_refused(tmp_path, tar_format):
    data = _sparse_tar(tmp_path, tar_format)
    with pytest.raises(CorruptShard, match=re.escape(f"s.tar: member 'b.bin' is {SPARSE}")):
        scan(data)


# --------------------------------------------------------------------------- pax headers


def _ustar_size_zero(data: bytes, name: str) -> bytes:
    """The layout tarfile writes for a member of 8 GiB or more: 0 in the ustar size field, the
    real size in the member's pax ``size`` record."""
    buf = bytearray(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        at = tar.getmember(name).offset_data - 512
    buf[at + 124 : at + 136] = b"%011o\0" % 0
    buf[at + 148 : at + 156] = b" " * 8
    buf[at + 148 : at + 156] = b"%06o\0 " % sum(buf[at : at + 512])
    return bytes(buf)


def test_a_pax_size_record_gives_the_member_its_size():
    big = bytes(1024) + b"R" * 1976  # its data starts with zero blocks, as an end of archive does
    data = _ustar_size_zero(
        tar_of(("0.jpg", b"first"), pax("a.raw", big, size=str(len(big))), ("a.cls", b"1"), ("b.jpg", b"B")), "a.raw"
    )
    index = scan(data)
    assert indexed(index) == tarfile_reads(data)
    assert list(index.keys) == ["0", "a", "b"]
    offset, size = indexed(index)[("a", "raw")]
    assert data[offset : offset + size] == big


def test_pax_records_are_read_by_their_lengths_not_split_at_newlines():
    data = tar_of(pax("real.jpg", b"RRR", **{"SCHILY.xattr.user.note": "x\n9 path=fake.jpg", "comment": "a=b\n"}),
                  pax("one.jpg", b"1", path="two=2.jpg"))
    index = scan(data)
    assert list(index.keys) == ["real", "two=2"]
    assert indexed(index) == tarfile_reads(data)


def test_a_global_pax_header_applies_to_the_members_after_it_as_tarfile_reads_them():
    data = tar_of(("a.jpg", b"A"), pax_headers={"path": "g.jpg", "comment": "written by a tool"})
    assert list(scan(data).keys) == ["g"] and tarfile_reads(data) == indexed(scan(data))
    global_size = raw_tar(("pax_global_header", tarfile.XGLTYPE, record("size", b"3")),
                          ("a.jpg", tarfile.REGTYPE, b"A"))
    with pytest.raises(CorruptShard, match="s.tar: the global pax header at byte 0 sets a size for every member"):
        scan(global_size)


@pytest.mark.parametrize("records", [
    b"99 path=x.jpg\n",  # longer than the header
    b"5 path=x.jpg\n",  # shorter than its record
    b"14 path=x.jpg!",  # not ended by a newline
    b"x path=x.jpg\n",  # no length
    b"10 pathx.jpg\n",  # no '='
    record("path", b"x.jpg") + b"junk",
])
def test_a_malformed_pax_record_is_refused_naming_the_tar_and_header(records):
    data = raw_tar(("0.jpg", tarfile.REGTYPE, b"0"), ("PaxHeader/x.jpg", tarfile.XHDTYPE, records),
                   ("x.jpg", tarfile.REGTYPE, b"X"))
    with pytest.raises(CorruptShard, match=r"^s.tar: the pax header at byte 1024 holds a malformed record") as caught:
        scan(data)
    assert caught.value.name == "s.tar"


def test_gnu_long_names_and_links_are_read_as_tarfile_reads_them():
    name = "d" * 120 + "/sample.jpg"
    link = tarfile.TarInfo("l" * 120 + ".lnk")
    link.type, link.linkname = tarfile.SYMTYPE, "t" * 150
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(link)
        for member, payload in ((name, b"long"), ("b.cls", b"2")):
            info = tarfile.TarInfo(member)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    data = buffer.getvalue()
    assert list(scan(data).keys) == ["d" * 120 + "/sample", "b"]
    assert indexed(scan(data)) == tarfile_reads(data)


# --------------------------------------------------------------------------- names


def test_field_names_are_lower_cased_as_webdataset_reads_them():
    data = tar_of(("IMG_1.JPG", b"J"), ("IMG_1.Cls", b"3"), ("IMG_2.jpg", b"j"), ("IMG_2.seg.PNG", b"p"))
    index = scan(data)
    assert index.fields == ("cls", "jpg", "seg.png") and list(index.keys) == ["IMG_1", "IMG_2"]
    assert indexed(index) == tarfile_reads(data)


def test_a_field_repeated_in_a_sample_is_refused_naming_the_member():
    for data, member in ((tar_of(("a.jpg", b"A1"), ("a.jpg", b"A2")), "a.jpg"),
                         (tar_of(("a.JPG", b"A1"), ("b.cls", b"1"), ("b.jpg", b"B"), ("b.Jpg", b"B2")), "b.Jpg")):
        with pytest.raises(CorruptShard, match=f"^s.tar: member '{member}' repeats field 'jpg' of sample"):
            scan(data)


def test_shards_we_wrote_keep_their_field_names_as_written():
    out = io.BytesIO()
    writer = ShardWriter(out.write)
    writer.add("000001", {"Image.png": b"png", "image.json": b"{}"})
    writer.close()
    assert scan(out.getvalue()).fields == ("Image.png", "image.json")


def test_a_member_whose_name_ends_with_a_dot_is_refused_not_dropped():
    with pytest.raises(CorruptShard, match=r"^s.tar: member 'a\.' cannot be read as a sample: its name ends with '\.'"):
        scan(tar_of(("a.", b"A"), ("b.jpg", b"B")))


# --------------------------------------------------------------------------- damaged objects


def test_a_truncated_tar_names_the_member_it_ends_in():
    data = tar_of(("a.jpg", b"A" * 100), ("b.jpg", b"B" * 5000), ("c.jpg", b"C"))
    with pytest.raises(CorruptShard, match=r"^s.tar is truncated: it ends at byte 4000, inside member 'b.jpg'"):
        scan(data[:4000])
    cut_header = r"^s.tar is truncated: it ends at byte 7000, inside the header at byte 6656"
    with pytest.raises(CorruptShard, match=cut_header):
        scan(data[:7000])


@pytest.mark.parametrize("compress, said", [(gzip.compress, "gzip"), (bz2.compress, "bzip2"), (lzma.compress, "xz")])
def test_a_compressed_tar_named_tar_is_refused_saying_so(compress, said):
    data = compress(os.urandom(4000) + tar_of(("c.jpg", b"C")))
    with pytest.raises(CorruptShard, match=rf"^s.tar is {said}-compressed \(it starts with .*\): a compressed tar"):
        scan(data)


def test_an_index_made_before_field_names_were_lower_cased_still_matches_its_tar():
    """``verify`` compares an index with its tar's headers: one indexed in place when field
    names kept their case (``JPG``) was reported as pointing at other bytes, though intact."""
    import dataclasses

    from remote_loader.read.reader import _index_against_tar

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in (("img0.JPG", b"\xff\xd8jpeg"), ("img0.cls", b"3")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = out.getvalue()
    index = scan(data)
    assert set(index.fields) == {"jpg", "cls"}
    before = dataclasses.replace(index, fields=tuple(f.upper() if f == "jpg" else f for f in index.fields))
    assert _index_against_tar(before, data, "s.tar") is None
    moved = dataclasses.replace(index, offsets=index.offsets[:, ::-1].copy())
    assert "points at other bytes" in (_index_against_tar(moved, data, "s.tar") or "")
