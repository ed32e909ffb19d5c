from __future__ import annotations

import math

import pytest

from tiercheck.format.layout import chunk_shape, chunks


@pytest.mark.parametrize(
    ("shape", "itemsize", "target"),
    [((1000, 7), 4, 4096), ((3, 5000, 7), 2, 4096), ((10**6,), 1, 65536), ((2, 3), 8, 4096), ((), 4, 4096),
     ((0, 5), 4, 4096), ((7, 1), 16, 16)],
)  # fmt: skip
def test_chunks_cover_the_array_exactly_once_within_target(shape: tuple[int, ...], itemsize: int, target: int) -> None:
    cshape = chunk_shape(shape, itemsize, target)
    assert len(cshape) == len(shape) and all(c >= 1 for c in cshape)
    if math.prod(shape) and itemsize <= target:
        assert math.prod(cshape) * itemsize <= target
    covered = sum(math.prod(c.valid_shape) for c in chunks(shape, cshape))
    assert covered == math.prod(shape)
    for c in chunks(shape, cshape):  # padding: a cut dimension wastes less than one index per chunk
        for d, (extent, size) in enumerate(zip(shape, cshape, strict=True)):
            parts = math.ceil(extent / size)
            assert parts * size - extent < parts, (d, c)


def test_zero_dim_has_one_chunk_named_c() -> None:
    assert [c.key for c in chunks((), ())] == ["c"]
    assert [c.key for c in chunks((5, 3), (2, 3))] == ["c.0.0", "c.1.0", "c.2.0"]
