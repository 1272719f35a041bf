"""``sagegrpo inspect-sde`` as a user runs it: a real subprocess, one-line errors, exit codes."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def _sagegrpo(*args):
    return subprocess.run(
        [sys.executable, "-m", "sage_grpo.pipeline.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_json_output_has_every_step_and_equalized_scales(tmp_path):
    plot = tmp_path / "sde.png"
    result = _sagegrpo(
        "inspect-sde",
        "--variant",
        "all",
        "--steps",
        "20",
        "--shift",
        "5",
        "--eta",
        "0.5",
        "--json",
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["variants"]) == {"dance", "flow", "cps", "sage"}
    rows = report["variants"]["sage"]
    assert len(rows) == 20 and rows[0]["sigma"] == 1.0 and rows[-1]["sigma_next"] == 0.0
    products = [r["N_t"] * r["S_t"] for r in rows if r["N_t"] is not None]
    assert max(products) / min(products) == pytest.approx(1.0, abs=1e-6)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_table_output_names_the_columns():
    result = _sagegrpo("inspect-sde", "--variant", "sage", "--steps", "4")
    assert result.returncode == 0
    assert "sigma_next" in result.stdout and "S_t" in result.stdout and len(result.stdout.splitlines()) == 6


@pytest.mark.parametrize("args", [["--variant", "ddim"], ["--eta", "-0.5"], ["--steps", "0"], ["--steps", "x"]])
def test_bad_values_give_one_line_and_exit_2(args):
    result = _sagegrpo("inspect-sde", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_output_piped_into_a_reader_that_stops_early_is_not_a_traceback():
    # `sagegrpo inspect-sde --json | head -c 100`: enough output to outlast the reader, which closes the pipe.
    command = [sys.executable, "-m", "sage_grpo.pipeline.cli", "inspect-sde", "--steps", "3000", "--json"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        child.stdout.read(100)
        child.stdout.close()
        stderr = child.stderr.read().decode()
        code = child.wait(timeout=120)
    assert "Traceback" not in stderr and stderr == "", stderr
    assert code == 1


@pytest.mark.parametrize("name, problem", [("missing/sde.png", "No such file or directory"), ("sde.xyz", "xyz")])
def test_a_plot_path_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, name, problem):
    result = _sagegrpo("inspect-sde", "--steps", "4", "--plot", str(tmp_path / name))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"sagegrpo: error: --plot {tmp_path / name}: ") and problem in result.stderr
