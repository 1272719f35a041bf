"""The reward server in a real process on loopback, and the ``remote`` reward calling it."""

import json
import logging
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from core.rewards import RewardSpec, VideoBatch
from stages.score import Scorer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SERVED_REWARDS = [
    {"name": "tiny-videoalign"},
    {"name": "brightness", "kwargs": {"target": 0.8}},
    {"name": "user_rewards.safety:KeywordSafety"},
]
# The client weighs what the server reports raw: setting B on VideoAlign plus the two cheap rewards.
CLIENT_WEIGHTS = {"VQ": 0.5, "MQ": 0.5, "TA": 1.0, "brightness": 2.0, "safety": 1.0}


@pytest.fixture(autouse=True)
def user_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def start_server(tmp_path, rewards):
    config = tmp_path / "rewards.yaml"
    config.write_text(yaml.safe_dump({"rewards": rewards}))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES)])}
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve-reward", str(config), "--port", "0",
                                "--device", "cpu"], cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("serving rewards on "):
        process.kill()
        pytest.fail(f"server did not start: {line!r}")
    return process, line.removeprefix("serving rewards on ").strip()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url = start_server(tmp_path_factory.mktemp("server"), SERVED_REWARDS)
    yield url
    process.terminate()
    process.wait(timeout=10)


def batch():
    generator = torch.Generator().manual_seed(5)
    return VideoBatch([torch.randint(0, 256, (8, 40, 56, 3), dtype=torch.uint8, generator=generator)
                       for _ in range(5)], fps=4.0)


PROMPTS = ["a red car", "blood on the floor", "a cat", "the sky", "a dog running"]


def test_health_lists_the_served_rewards(server):
    with urllib.request.urlopen(f"{server}/health", timeout=10) as response:
        assert json.load(response) == {"status": "ok",
                                       "rewards": [reward["name"] for reward in SERVED_REWARDS]}


def test_remote_scores_equal_in_process_scores(server):
    remote = Scorer([RewardSpec(name="remote", kwargs={"url": server, "batch_size": 2, "timeout": 60},
                                weights=CLIENT_WEIGHTS)], retries=0)
    local = Scorer([RewardSpec(name="tiny-videoalign", weights="setting_b"),
                    RewardSpec(name="brightness", kwargs={"target": 0.8}, weights={"brightness": 2.0}),
                    RewardSpec(name="user_rewards.safety:KeywordSafety", weights={"safety": 1.0})])
    over_http, in_process = remote.score(batch(), PROMPTS), local.score(batch(), PROMPTS)
    assert set(over_http.dimensions) == {"VQ", "MQ", "TA", "Overall", "brightness", "safety", "prompt_words"}
    for name, values in in_process.dimensions.items():
        assert over_http.dimensions[name] == pytest.approx(values, abs=1e-6), name
    assert over_http.total == pytest.approx(in_process.total, abs=1e-6)
    assert over_http.dimensions["safety"][1] == 0.0


def test_server_down_retries_then_scores_none(caplog):
    with socket.socket() as probe:             # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    scorer = Scorer([RewardSpec(name="remote", kwargs={"url": f"http://127.0.0.1:{port}", "retries": 2,
                                                       "backoff": 0.0, "timeout": 5}, weights={"VQ": 1.0})])
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
        result = scorer.score(batch(), PROMPTS)
    retries = [record for record in caplog.records if record.name == "urllib3.connectionpool"
               and "Retrying" in record.getMessage()]
    assert len(retries) == 2
    assert result.total == [None] * 5 and result.dimensions["VQ"] == [None] * 5
    assert scorer.failures["remote"] == 5


def test_failing_served_reward_answers_500_and_the_client_retries_it(tmp_path, caplog):
    process, url = start_server(tmp_path, [{"name": "user_rewards.safety:Flaky", "kwargs": {"failures": 100}}])
    try:
        scorer = Scorer([RewardSpec(name="remote", kwargs={"url": url, "retries": 1, "backoff": 0.0})])
        with caplog.at_level(logging.WARNING):
            result = scorer.score(batch()[:2], PROMPTS[:2])
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert result.total == [None, None] and result.failed == {"remote": 2}
    assert any("answered 500" in record.getMessage() and "judge API timed out" in record.getMessage()
               for record in caplog.records)


def test_bad_config_exits_2_with_one_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"rewards": [{"name": "brightness", "wieghts": {"x": 1}}]}))
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "serve-reward", str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "rewards.0.wieghts" in result.stderr
