"""``ptdstream.progress.Stages``: one line as a stage begins, one with its seconds as it
ends; stages that follow one another (``begin``) and blocks (``stage``); nothing for a
stage that raised; silent without a stream."""

from __future__ import annotations

import io
import re

import pytest

from ptdstream.progress import Stages


def _lines(stream: io.StringIO) -> list[str]:
    """The lines written, with each duration replaced by ``S``."""
    return [re.sub(r"\d+\.\d s", "S s", line) for line in stream.getvalue().splitlines()]


def test_begin_ends_the_stage_before_and_end_ends_the_last():
    out = io.StringIO()
    stages = Stages(out, elapsed=True)
    stages.begin("load")
    stages.begin("export")
    stages.end()
    stages.end()  # nothing current: no line
    assert _lines(out) == ["[1] load ...", "[1] load: done in S s (S s in all)", "[2] export ...",
                           "[2] export: done in S s (S s in all)"]


def test_a_block_stage_with_a_known_total():
    out = io.StringIO()
    stages = Stages(out, 2)
    with stages.stage("export 2 methods"):
        pass
    with pytest.raises(ValueError), stages.stage("lower"):
        raise ValueError("lowering failed")
    stages.end()  # the stage that raised was dropped: no "done" for it
    assert _lines(out) == ["[1/2] export 2 methods ...", "[1/2] export 2 methods: done in S s", "[2/2] lower ..."]


def test_the_seconds_are_the_stage_s_own_and_in_all_since_the_first(monkeypatch):
    clock = iter([10.0, 12.5, 12.5, 20.0])
    monkeypatch.setattr("ptdstream.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    stages = Stages(out, elapsed=True)
    stages.begin("a")
    stages.begin("b")
    stages.end()
    assert out.getvalue().splitlines() == ["[1] a ...", "[1] a: done in 2.5 s (2.5 s in all)", "[2] b ...",
                                           "[2] b: done in 7.5 s (10.0 s in all)"]


def test_no_stream_prints_nothing(capsys):
    stages = Stages(None, 1)
    with stages.stage("quiet"):
        pass
    assert capsys.readouterr() == ("", "")
