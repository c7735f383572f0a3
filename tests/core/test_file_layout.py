"""Where a graph's weights go when it is saved over its own weights file (core/file_layout.py)."""

from __future__ import annotations

from tensorsmith.core.file_layout import plan_layout

USED = [(60, 100), (0, 40)]  # two weights stay; bytes 40-60 are no weight's any more


def test_a_new_weight_goes_into_bytes_no_weight_reads() -> None:
    layout = plan_layout(100, USED, [], [(1, 15, True), (2, 10, True)], 1.0)  # first fit; the second does not fit
    assert layout is not None and (layout.placed, layout.appended, layout.unread) == ({1: 40}, 10, 5)
    assert plan_layout(100, USED, [], [(1, 15, True), (2, 10, True)], 0.0) is None  # 5 bytes left unread
    layout = plan_layout(100, USED, [], [(1, 15, True), (2, 5, True)], 0.0)
    assert layout is not None and (layout.placed, layout.appended, layout.unread) == ({1: 40, 2: 55}, 0, 0)


def test_bytes_still_read_or_too_many_unread_are_not_reused() -> None:
    # a value still to be written reads bytes 40-60: nothing goes there, and they are unread afterwards
    layout = plan_layout(100, USED, [(40, 60)], [(1, 20, True)], 1.0)
    assert layout is not None and (layout.placed, layout.appended, layout.unread) == ({}, 20, 20)
    assert plan_layout(100, USED, [(40, 60)], [(1, 20, True)], 0.1) is None  # 20 of 120 unread: rewritten whole
    layout = plan_layout(100, USED, [], [(1, 20, False)], 1.0)  # bytes not known before it is written: appended
    assert layout is not None and layout.placed == {} and layout.appended == 20
