"""The quick tier's covering subset (tests/conftest.py): every value of every parameter runs at
least once, and what it leaves out is exactly what `--exhaustive` runs."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from tests.conftest import _covering_subset, _exhaustive_only


class _Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return name if name in self.marks else None


def _items(name, grid, marks=()):
    keys = list(grid)
    out = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(keys, values))
        out.append(_Item(nodeid=f"tests/kernels/t.py::{name}[{'-'.join(map(str, values))}]", path="t.py",
                         originalname=name, callspec=SimpleNamespace(params=params), marks=set(marks)))
    return out


def test_every_value_of_every_parameter_is_kept():
    grid = {"dtype": ["f32", "bf16"], "shape": [(1, 2), (3, 4), (5, 6)], "mode": ["a", "b", "c", "d"]}
    items = _items("t", grid)
    keep = _covering_subset(items)
    assert len(keep) == 4  # the largest parameter's value count, not 2 * 3 * 4
    kept = [it for it in items if it.nodeid in keep]
    for name, values in grid.items():
        assert {repr(it.callspec.params[name]) for it in kept} == {repr(v) for v in values}, name


def test_tiers_partition_the_suite():
    single = _items("one", {"t": [1, 2, 3]})
    multi = _items("two", {"a": [1, 2], "b": [1, 2]})
    marked = _items("heavy", {"t": [1]}, marks={"exhaustive"})
    plain = [_Item(nodeid="tests/x.py::plain", marks=set())]
    items = single + multi + marked + plain
    out = _exhaustive_only(items)
    assert not out & {it.nodeid for it in single + plain}  # one parameter: every value is needed
    assert {it.nodeid for it in marked} <= out
    assert len(out & {it.nodeid for it in multi}) == 2  # two of the four combinations cover a and b
