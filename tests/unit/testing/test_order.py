from miles.testing.order import SHORT_TAIL, spread_long


def _items(short: int, long_costs: list[float]) -> list[tuple[str, float]]:
    # collected as path order has them: the long runs together, ahead of the short tests
    return [(f"long{i}", c) for i, c in enumerate(long_costs)] + [(f"short{i}", 0.0) for i in range(short)]


def _cost(item: tuple[str, float]) -> float:
    return item[1]


def test_long_runs_are_spread_longest_first_and_the_short_tests_keep_their_order():
    items = _items(100, [90, 150, 90, 150, 60])
    ordered = spread_long(items, _cost)
    assert sorted(ordered) == sorted(items)
    assert [i for i in ordered if i[1] == 0] == [i for i in items if i[1] == 0]
    assert [i[0] for i in ordered if i[1] > 0] == ["long1", "long3", "long0", "long2", "long4"]
    positions = [n for n, item in enumerate(ordered) if item[1] > 0]
    gaps = [b - a for a, b in zip(positions, positions[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spaced, not bunched


def test_the_short_tail_holds_no_long_run_and_each_first_chunk_of_two_workers_holds_some():
    items = _items(1600, [90.0] * 12)
    ordered = spread_long(items, _cost)
    tail = ordered[int(len(ordered) * (1 - SHORT_TAIL)):]
    assert all(cost == 0 for _, cost in tail)
    # xdist's load scheduling starts each of 2 workers on a contiguous eighth of the collection
    eighth = len(ordered) // 8
    for chunk in (ordered[:eighth], ordered[eighth:2 * eighth]):
        assert any(cost > 0 for _, cost in chunk)


def test_nothing_to_spread_leaves_the_order_as_it_was():
    assert spread_long(_items(5, []), _cost) == _items(5, [])
    assert spread_long(_items(0, [3.0, 5.0]), _cost) == _items(0, [3.0, 5.0])
