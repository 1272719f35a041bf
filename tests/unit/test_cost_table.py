"""The cost table's command: every shipped HunyuanVideo 1.5 and Wan 2.2 A14B config and the levers, written between
the markers."""

import pytest

from benchmarks import cost_table
from sage_grpo.core import memory_trace
from sage_grpo.pipeline import memory_plan, phase_plan

pytestmark = pytest.mark.unit


@pytest.fixture
def stub_traces(monkeypatch):
    """A call costs 1e15 FLOPs per sequence in it and adds 1 GiB: the real traces are tested elsewhere."""
    calls = []

    def trace(transformer_config, call, lora_config=None, dtype=None, expert=None):
        calls.append(call)
        return memory_trace.StepTrace(peak=2**30, flops=call.batch * 10**15)

    monkeypatch.setattr(memory_trace, "trace_hunyuanvideo15", trace)
    monkeypatch.setattr(memory_trace, "trace_wan", trace)
    for counts in ("frozen_parameter_counts", "wan_frozen_parameter_counts"):
        monkeypatch.setattr(phase_plan, counts, lambda rewards: {"VAE": 10**9})
    # The transformers' counts on the meta device take seconds a config: their numbers, counted once.
    shape = memory_plan.TransformerShape(8_330_000_000, 8_330_000_000, 151_000_000, 2048, 16, 54, 32)
    monkeypatch.setattr(memory_plan, "hunyuanvideo15_shape", lambda *args: shape)
    a14b = memory_plan.TransformerShape(28_580_000_000, 28_580_000_000, 350_000_000, 5120, 40, 40, 16, (1, 2, 2))
    monkeypatch.setattr(memory_plan, "wan_shape", lambda *args: a14b)
    return calls


def _flops(line: str) -> float:
    return float(line.split("|")[4])


def test_the_table_lists_every_config_and_each_lever_saves_flops(tmp_path, stub_traces):
    docs = tmp_path / "scale-out.md"
    docs.write_text(f"before\n{cost_table.BEGIN}\nold table\n{cost_table.END}\nafter\n")
    assert cost_table.main(["--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "old table" not in text and text.startswith("before\n") and text.endswith("after\n")
    rows = [line for line in text.splitlines() if line.startswith("| ") and ".yaml |" in line]
    shipped = sorted(
        path.name
        for pattern in ("hunyuanvideo15_*", "wan22_*")
        for path in cost_table.REPO.glob(f"configs/{pattern}.yaml")
    )
    assert sorted({row.split("|")[1].strip() for row in rows}) == shipped
    full = {row.split("|")[3].strip(): _flops(row) for row in rows if "hunyuanvideo15_sage_full" in row}
    # 8 samples, 20 rollout steps of 1 call, 20 trained steps (the last one too) of a training call and 2 reference
    # calls (dual).
    assert full["as shipped"] == pytest.approx(64 * 8 * (20 * 2 + 20 * (2 + 2 * 2)) * 1e15, rel=1e-3)
    assert full["2 trained steps"] < full["as shipped"] and full["no CFG"] == pytest.approx(
        full["as shipped"] / 2, rel=2e-3
    )
    # Wan 2.2 A14B at K = 2 (32 groups of 2 GPUs): 8 samples, 20 steps of one expert each, all trained; no CFG turns
    # off both experts' guidance.
    wan = {row.split("|")[3].strip(): _flops(row) for row in rows if "wan22_a14b_sage_full" in row}
    assert wan["as shipped"] == pytest.approx(32 * 8 * (20 * 2 + 20 * (2 + 2 * 2)) * 1e15, rel=1e-3)
    assert wan["2 trained steps"] < wan["as shipped"] and wan["no CFG"] == pytest.approx(
        wan["as shipped"] / 2, rel=2e-3
    )


def test_a_file_without_markers_is_refused(tmp_path, stub_traces, capsys):
    docs = tmp_path / "scale-out.md"
    docs.write_text("no markers\n")
    assert cost_table.main(["--docs", str(docs)]) == 2
    assert "markers" in capsys.readouterr().err
