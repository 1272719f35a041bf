"""sage_grpo.core.progress: tqdm's own conventions for every bar of the pipeline."""

import io

import pytest

from sage_grpo.core import distributed
from sage_grpo.core.progress import progress_bar

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _drawn(monkeypatch, stream, **kwargs) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    with progress_bar(total=3, mininterval=0, **kwargs) as bar:
        bar.update(3)
    return stream.getvalue()


@pytest.fixture(autouse=True)
def no_setting(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def test_bars_are_drawn_on_a_terminal_only(monkeypatch):
    assert "3/3" in _drawn(monkeypatch, Terminal())
    assert _drawn(monkeypatch, io.StringIO()) == ""


def test_tqdm_disable_is_honoured_both_ways(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert _drawn(monkeypatch, Terminal()) == ""
    monkeypatch.setenv("TQDM_DISABLE", "")  # tqdm reads it as disable=False: drawn off a terminal too
    assert "3/3" in _drawn(monkeypatch, io.StringIO())


def test_never_on_other_ranks_or_when_the_caller_turns_it_off(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "")
    assert _drawn(monkeypatch, Terminal(), enabled=False) == ""
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    assert _drawn(monkeypatch, Terminal()) == ""
