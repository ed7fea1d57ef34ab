"""jaxspec.pallas.tiles' config checks, shared by every kernel's frozen config dataclass."""

import dataclasses

import pytest

from jaxspec.pallas import tiles


@dataclasses.dataclass(frozen=True)
class Config:
    tile: object = 64
    stages: object = 3
    splits: object = None


@pytest.mark.parametrize(
    "tile,ok",
    [(16, True), (256, True), (1024, True), (8, False), (48, False), (True, False), (64.0, False), (0, False)],
)
def test_pow2_fields(tile, ok):
    check = lambda: tiles.check_pow2_fields(Config(tile=tile), (("tile", 16, None),))  # noqa: E731
    if ok:
        check()
    else:
        with pytest.raises(ValueError, match=r"Config\.tile=.*power of two >= 16"):
            check()
    with pytest.raises(ValueError, match=r"Config\.tile=1024: must be a power of two in \[16, 256\]"):
        tiles.check_pow2_fields(Config(tile=1024), (("tile", 16, 256),))


@pytest.mark.parametrize("stages,ok", [(1, True), (8, True), (0, False), (9, False), (True, False), (2.0, False)])
def test_int_fields_and_optional_ones(stages, ok):
    ranges = tiles.given_fields(Config(stages=stages), (("stages", 1, 8), ("splits", 1, 4)))
    assert [name for name, _, _ in ranges] == ["stages"]  # splits is None: chosen per call, not checked
    if ok:
        tiles.check_int_fields(Config(stages=stages), ranges)
    else:
        with pytest.raises(ValueError, match=r"Config\.stages=.*: must be an int in \[1, 8\]"):
            tiles.check_int_fields(Config(stages=stages), ranges)
