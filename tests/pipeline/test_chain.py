"""``Chain``: what a pipeline's items hold of its samples, asked in one place."""

from __future__ import annotations

import pytest

from remote_loader.pipeline.stages.chain import ONE, Cardinality, Chain

BATCH_4 = Cardinality(4, batches=True)
BATCH_4_FULL = Cardinality(4, batches=True, keep_short=False)
FILTER = Cardinality(filters=True)
SELECT = Cardinality(size=None, filters=True)


@pytest.mark.parametrize(("parts", "samples", "items"), [
    ((), 10, 10),
    ((ONE, FILTER, ONE), 10, 10),  # a filter of failures counts as one to one
    ((ONE, BATCH_4), 10, 3),
    ((ONE, BATCH_4_FULL), 10, 2),
    ((BATCH_4, Cardinality(2, batches=True)), 10, 2),  # 3 batches of samples, then 2 of those
    ((SELECT, BATCH_4), 10, None),
])
def test_outputs_fold_the_stages_in_order(parts, samples, items):
    assert Chain(parts).outputs(samples) == items


def test_align_is_the_samples_an_item_holds_where_fixed():
    assert Chain((ONE, BATCH_4, Cardinality(3, batches=True))).align() == 12
    assert Chain((SELECT, BATCH_4)).align() == 1
    assert Chain(()).align() == 1


@pytest.mark.parametrize(("parts", "per_item"), [
    ((), 1),
    ((ONE, FILTER), 1),
    ((ONE, BATCH_4), 4),
    ((BATCH_4, ONE), None),  # a batch inside: items are not samples
    ((SELECT,), None),
    ((BATCH_4, BATCH_4), None),
])
def test_per_item_holds_only_where_an_item_count_says_how_many_samples(parts, per_item):
    assert Chain(parts).per_item() == per_item


def test_inputs_walk_back_batches_and_filters():
    chain = Chain((ONE, FILTER, BATCH_4))
    kept = {1: lambda n: n + 3}  # the filter took in 3 more than it gave out
    taken_by = lambda i, n: kept[i](n)  # noqa: E731
    assert chain.inputs(5, 3, taken_by) == 5  # after the last stage: the items themselves
    assert chain.inputs(5, 2, taken_by) == 20  # into the batches
    assert chain.inputs(5, 1, taken_by) == 23  # into the filter
    assert chain.inputs(5, 0, taken_by) == 23
    assert chain.filters == [1] and chain.batches
    assert chain.one_to_one(2) and not chain.one_to_one()
