"""``UploadSummary``: what an upload did, apart from what it found done already."""

from __future__ import annotations

from dataclasses import dataclass

from remote_loader.format import Manifest
from remote_loader.storage import Location


@dataclass(frozen=True)
class UploadSummary:
    """What an upload did.

    Attributes:
        location: Where the dataset is.
        samples: Samples in the dataset.
        shards: Shard objects in the dataset.
        bytes: Their total size.
        skipped: Source samples skipped by ``on_error="skip"``.
        seconds: Wall time of this call.
        kept_shards: Shards found complete from an earlier, interrupted run and kept (all of
            them when the dataset was there already).
        skip_reasons: Why samples were skipped, one line each (the first 100).
        kept_samples: Samples of the kept shards.
        kept_bytes: Bytes of the kept shards.
        writing_seconds: The part of ``seconds`` spent writing shards (reading each ``ds[i]``, which for a
            generated dataset includes making it, encoding and sending), and reading kept
            items again to compare them, the span the progress bar shows; the rest opened the
            dataset, claimed the prefix, and wrote the manifest.
        compared: Kept samples whose items were read again and compared with the digests
            recorded as they were uploaded (``verify``): all of them, unless ``verify`` was
            off or some were uploaded before uploads recorded digests.
        sampled: Items of the dataset every run compares (its fingerprint: up to 128 spread
            over it), which is all a kept sample not ``compared`` was checked by.
        verified: Whether the call was asked to read and compare every kept item (``verify``).
        rewritten: Tasks of an interrupted run that this call found changed and wrote again,
            each as the first item found to differ in it.

    The rates (``samples_per_s``, ``mb_per_s``) are of what this call uploaded, not of what it
    kept, over ``writing_seconds``: the progress bar's final rate. Bytes are the shards' own
    (tar headers and each shard's index included), in MB of 10^6 bytes, as the bar counts them.
    """

    location: Location
    samples: int
    shards: int
    bytes: int
    skipped: int
    seconds: float
    kept_shards: int = 0
    skip_reasons: tuple[str, ...] = ()
    kept_samples: int = 0
    kept_bytes: int = 0
    writing_seconds: float = 0.0
    compared: int = 0
    sampled: int = 0
    verified: bool = True
    rewritten: tuple[int, ...] = ()

    @classmethod
    def kept_whole(cls, location: Location, manifest: Manifest, seconds: float, *, compared: int, sampled: int,
                   verified: bool, reading: float = 0.0) -> UploadSummary:
        """The summary of a call that found the dataset there already, uploaded with its
        parameters, over the same items as far as it ``compared`` them."""
        return cls(location, manifest.num_samples, len(manifest.shards), manifest.num_bytes, manifest.skipped, seconds,
                   kept_shards=len(manifest.shards), kept_samples=manifest.num_samples, kept_bytes=manifest.num_bytes,
                   writing_seconds=reading, compared=compared, sampled=sampled, verified=verified)

    @property
    def uploaded_samples(self) -> int:
        """Samples this call uploaded."""
        return self.samples - self.kept_samples

    @property
    def uploaded_shards(self) -> int:
        """Shards this call uploaded."""
        return self.shards - self.kept_shards

    @property
    def uploaded_bytes(self) -> int:
        """Bytes this call uploaded."""
        return self.bytes - self.kept_bytes

    @property
    def mb_per_s(self) -> float:
        return self.uploaded_bytes / 1e6 / self.writing_seconds if self.writing_seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.uploaded_samples / self.writing_seconds if self.writing_seconds > 0 else 0.0

    @property
    def all_compared(self) -> bool:
        """Whether every kept item was compared: read again, or among the sampled items."""
        return self.compared == self.kept_samples or self.sampled >= self.samples + self.skipped

    def _compared(self) -> str:
        """How the kept items were found the same, in words."""
        if self.compared == self.kept_samples:
            return f"all {_count(self.compared, 'item')} read and compared"
        if self.sampled >= self.samples + self.skipped:
            return f"all {_count(self.sampled, 'item')} compared"
        sampled = _count(self.sampled, "sampled item")
        if not self.verified:
            return f"only the {sampled} compared (verify=False; verify=True reads and compares every item)"
        if not self.compared:
            return (f"only the {sampled} compared (it was uploaded before uploads recorded a digest of each item:"
                    " overwrite=True uploads it again)")
        return (f"{_count(self.compared, 'item')} read and compared, the other {self.kept_samples - self.compared}"
                f" (uploaded before uploads recorded a digest of each item) only where among the {sampled}"
                " (overwrite=True uploads them again)")

    def __str__(self) -> str:
        whole = f"{_count(self.samples, 'sample')} in {_count(self.shards, 'shard')} ({self.bytes / 1e6:.1f} MB)"
        if not self.uploaded_shards:
            if self.all_compared:
                return (f"{self.location} already holds this dataset, {whole}: {self._compared()}, nothing to upload"
                        f" ({self.seconds:.1f} s)")
            return (f"{self.location} holds a dataset uploaded with these parameters, {whole}: nothing uploaded,"
                    f" {self._compared()} ({self.seconds:.1f} s)")
        kept = (f"; kept {_count(self.kept_shards, 'shard')} ({_count(self.kept_samples, 'sample')}) from an earlier"
                f" run, {self._compared()}, the dataset now {whole}") if self.kept_shards else ""
        if self.rewritten:
            kept += (f"; wrote again {_count(len(self.rewritten), 'task')} of the earlier run whose items changed"
                     f" since (ds[{self.rewritten[0]}] first)")
        return (
            f"uploaded {_count(self.uploaded_samples, 'sample')} in {_count(self.uploaded_shards, 'shard')}"
            f" ({self.uploaded_bytes / 1e6:.1f} MB) to {self.location} in {self.seconds:.1f} s, of which"
            f" {self.writing_seconds:.1f} s reading ds[i], encoding and writing at"
            f" {self.samples_per_s:,.0f} samples/s,"
            f" {self.mb_per_s:.1f} MB/s; skipped {self.skipped}{kept}"
        ) + "".join(f"\n  skipped: {reason}" for reason in self.skip_reasons[:10])


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
