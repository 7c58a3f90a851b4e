"""An upload gathers its shards as arrays as tasks finish: the manifest's names follow the
template docs/FORMAT.md describes, and what it holds is its columns (pure, no server)."""

from __future__ import annotations

import tracemalloc

import pytest

from remote_loader.format import Manifest, ShardEntry
from remote_loader.upload.tasks import TaskResult, shard_name
from remote_loader.upload.written import Written

RUN = "0a1b2c3d"


def result(task: int, parts: int, **extra) -> TaskResult:
    entries = [ShardEntry(shard_name(RUN, task, p), 3 + p, 10_000 + task, 8_000, 100, task, p) for p in range(parts)]
    return TaskResult(task, entries, **extra)


@pytest.mark.parametrize("parts, template", [
    ({4: 1}, ([f"shard-{RUN}-000004-000.tar"], [])),
    ({0: 1, 1: 1, 7: 1}, ([f"shard-{RUN}-", "-000.tar"], [6])),
    ({0: 2, 1: 0, 2: 3}, ([f"shard-{RUN}-", "-", ".tar"], [6, 3])),
    ({0: 2, 1: 1}, ([f"shard-{RUN}-", "-", ".tar"], [6, 3])),  # the last task one shard, not the upload
])
def test_the_shards_come_back_in_task_order_under_the_documented_template(parts, template):
    written = Written(RUN)
    results = [result(task, n) for task, n in parts.items()]
    for r in reversed(results):  # tasks finish in any order
        written.add(r)
    table = written.table()
    encoded = Manifest(shards=table, fields=("cls",), version=2).encode()
    names = Manifest.decode(encoded, name="m").shards.names
    assert [names.parts, names.widths] == [tuple(template[0]), tuple(template[1])]
    assert list(table) == [e for r in results for e in r.entries]


def test_skips_and_their_reasons_are_kept_in_task_order():
    written = Written(RUN)
    written.add(result(2, 1, skipped=[9], reasons=["bad 9"], fields=["jpg"]))
    written.add(result(0, 1, skipped=[1, 3], reasons=["bad 1", "bad 3"], fields=["cls"]))
    assert sorted(written.skipped) == [1, 3, 9] and written.reasons() == ("bad 1", "bad 3", "bad 9")
    assert written.fields == {"cls", "jpg"}


def test_a_result_naming_another_shard_is_refused():
    written = Written(RUN)
    bad = result(1, 2)
    bad.entries[1] = ShardEntry("shard-ffffffff-000001-001.tar", 3, 10_000, 8_000, 100, 0, 0)
    with pytest.raises(RuntimeError, match="as its shard 1"):
        written.add(bad)


def test_it_holds_its_columns_not_an_object_per_shard():
    written = Written(RUN)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for task in range(20_000):
            written.add(result(task, 10))  # 200,000 shards; each result goes once taken
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert written.shards == 200_000
    assert held / 200_000 < 100, f"{held / 200_000:.0f} bytes a shard"  # the rows are 48; an entry object ~500
