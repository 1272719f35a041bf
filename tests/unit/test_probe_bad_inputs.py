"""The bad-inputs probe: inputs that used to end in a traceback where one line is promised. Config files in other
encodings or with line breaks in a key, DeepSpeed JSON in shapes DeepSpeed's own shorthand allows, kwargs of the
wrong type, output folders that cannot be folders: each is refused as one line, exit 2, nothing written. A prompt
line the JSON reader cannot take (nested past its limit, an integer past Python's 4300 digits) is skipped and
counted like any other bad line."""

import json
import os
import time
from pathlib import Path

import pytest

from sage_grpo.core.errors import RetryableStop
from sage_grpo.core.tracking import FAIL_FAST_HTTP
from sage_grpo.stages.ingest import DataConfig, ingest
from tests.helpers import free_port, refused_in_one_line, sagegrpo

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
DEEP = 100_000


def _config_bytes(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "run.yaml"
    path.write_bytes(data)
    return str(path)


def _demo_text() -> str:
    # data.source made absolute, so the copy reads the same prompts from anywhere
    return DEMO.read_text().replace("configs/demo_prompts.txt", str(REPO / "configs" / "demo_prompts.txt"))


# --- Config files --------------------------------------------------------------------------------------------------

# (how the file is written, what the one line must say)
CONFIG_FILES = {
    "latin-1": (lambda text: ("# café\n" + text).encode("latin-1"), "is not UTF-8 text"),
    "utf-16-without-mark": (lambda text: text.encode("utf-16-le"), "NUL bytes"),
    "utf-32-without-mark": (lambda text: text.encode("utf-32-be"), "NUL bytes"),
    "utf-16-broken": (lambda text: text.encode("utf-16")[:-1], "is not UTF-16 text"),
    "key-with-newline": (lambda text: (text + '"run\\nname": x\n').encode(), "run\\nname: unknown key"),
    "key-with-line-separator": (lambda text: (text + '"a\\u2028b": 1\n').encode(), "a\\u2028b: unknown key"),
    "key-with-carriage-return": (lambda text: (text + '"a\\rb": 1\n').encode(), "a\\rb: unknown key"),
    "nested-key-with-newline": (
        lambda text: text.replace("  max_iterations: 8", '  "max_\\niterations": 8').encode(),
        "run.max_\\niterations: unknown key",
    ),
}


@pytest.mark.parametrize("kind", sorted(CONFIG_FILES))
def test_a_config_file_that_cannot_be_read_as_text_or_has_line_breaks_in_a_key_is_one_line(capsys, tmp_path, kind):
    write, message = CONFIG_FILES[kind]
    path = _config_bytes(tmp_path, write(_demo_text()))
    assert message in refused_in_one_line(capsys, ["config", path], path)


def test_an_unreadable_config_file_is_one_line(capsys, tmp_path, monkeypatch):
    path = _config_bytes(tmp_path, _demo_text().encode())

    def unreadable(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", unreadable)  # root reads through any mode bits
    assert "Permission denied" in refused_in_one_line(capsys, ["config", path], path)


@pytest.mark.parametrize("codec", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
def test_a_config_with_a_byte_order_mark_reads_as_the_utf8_one(capsys, tmp_path, codec):
    from sage_grpo.pipeline import cli

    text = _demo_text()
    if codec == "utf-16-be":  # Python's utf-16-be writes no mark: add it, as editors do
        data = "\ufeff".encode(codec) + text.encode(codec)
    else:
        data = text.encode(codec)
    assert cli.main(["config", _config_bytes(tmp_path, text.encode())]) == 0
    expected = capsys.readouterr().out
    assert cli.main(["config", _config_bytes(tmp_path, data)]) == 0
    assert capsys.readouterr().out == expected


# --- DeepSpeed JSON ------------------------------------------------------------------------------------------------

DEEPSPEED_FILES = {
    "bf16-true": '{"bf16": true}',
    "fp16-true": '{"fp16": true}',
    "bf16-null": '{"bf16": null}',
    "bf16-enabled-yes": '{"bf16": {"enabled": "yes"}}',
    "fp16-enabled-number": '{"fp16": {"enabled": 1}}',
    "zero-a-list": '{"zero_optimization": [3]}',
    "stage-true": '{"zero_optimization": {"stage": true}}',
    "stage-false": '{"zero_optimization": {"stage": false}}',
    "stage-string": '{"zero_optimization": {"stage": "3"}}',
    "stage-float": '{"zero_optimization": {"stage": 3.0}}',
    "offload-string": '{"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}}',
    "offload-param-string": '{"zero_optimization": {"stage": 3, "offload_param": "nvme"}}',
    "offload-list": '{"zero_optimization": {"stage": 3, "offload_param": ["cpu"]}}',
    "offload-device-number": '{"zero_optimization": {"stage": 3, "offload_param": {"device": 1}}}',
    "offload-device-object": '{"zero_optimization": {"stage": 3, "offload_param": {"device": {"cpu": 1}}}}',
    "nested-lists": "[" * DEEP + "]" * DEEP,
    "nested-objects": '{"a": ' * DEEP + "1" + "}" * DEEP,
    "nested-in-a-block": '{"zero_optimization": ' + "[" * DEEP + "]" * DEEP + "}",
    "utf-16": '{"bf16": {"enabled": "auto"}}'.encode("utf-16"),
}


@pytest.mark.parametrize("kind", sorted(DEEPSPEED_FILES))
def test_each_deepspeed_json_deepspeed_shorthand_or_depth_would_crash_on_is_one_line(capsys, tmp_path, kind):
    text = DEEPSPEED_FILES[kind]
    path = tmp_path / f"{kind}.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused_in_one_line(capsys, ["config", str(DEMO), f"deepspeed.config={path}"], "deepspeed.config")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_integer_zero_stage_is_still_accepted(capsys, tmp_path, stage):
    from sage_grpo.pipeline import cli

    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage}}))
    assert cli.main(["config", str(DEMO), f"deepspeed.config={path}"]) == 0, capsys.readouterr().err


# --- kwargs of the wrong type --------------------------------------------------------------------------------------

# (override, the key the one line names, the parameter it names)
WRONG_TYPES = [
    ("rewards=[{name: brightness, kwargs: {target: abc}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: brightness, kwargs: {target: [1]}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: brightness, kwargs: {target: {a: 1}}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: brightness, kwargs: {target: null}}]", "rewards.0.kwargs", "target"),
    ("rewards=[{name: remote, kwargs: {url: 'http://h:1/', batch_size: eight}}]", "rewards.0.kwargs", "batch_size"),
    ("rewards=[{name: remote, kwargs: {url: 'http://h:1/', concurrency: 1.5}}]", "rewards.0.kwargs", "concurrency"),
    ("rewards=[{name: remote, kwargs: {url: [1]}}]", "rewards.0.kwargs", "url"),
    ("model.kwargs.seed=[1]", "model.kwargs", "seed"),
    ("model.kwargs.height=tall", "model.kwargs", "height"),
    ("model.kwargs.transformer=5", "model.kwargs", "transformer"),
]


@pytest.mark.parametrize(("override", "key", "parameter"), WRONG_TYPES, ids=[case[0] for case in WRONG_TYPES])
def test_a_kwarg_its_parameter_type_cannot_take_is_one_line_naming_it(capsys, override, key, parameter):
    line = refused_in_one_line(capsys, ["config", str(DEMO), override], key)
    assert f"{key}: {parameter}: " in line, line


@pytest.mark.parametrize(
    "override",
    [
        "rewards=[{name: brightness, kwargs: {target: 1}}]",  # an int is a float
        "model.kwargs.transformer={num_layers: 1}",
        "rewards=[{name: 'user_rewards.credentials:AuthenticatedJudge', kwargs: {url: u, bearer: b, api_key: k}}]",
    ],
)
def test_kwargs_of_their_types_still_pass(capsys, monkeypatch, override):
    from sage_grpo.pipeline import cli

    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures"))
    assert cli.main(["config", str(DEMO), override]) == 0, capsys.readouterr().err


# --- Output folders ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("run.output_dir={file}", "run.output_dir"),
        ("run.output_dir={file}/run", "run.output_dir"),
        ("run.output_dir=/proc/sagegrpo-probe", "run.output_dir"),  # cannot be created, even by root
        ("checkpoint.uri={file}", "checkpoint.uri"),
        ("checkpoint.uri=file://{file}/ckpt", "checkpoint.uri"),
        ("checkpoint.uri=/proc/sagegrpo-probe", "checkpoint.uri"),
    ],
    ids=["output-file", "output-under-file", "output-unwritable", "ckpt-file", "ckpt-under-file", "ckpt-unwritable"],
)
def test_a_folder_that_cannot_be_one_is_one_line_before_anything_is_written(tmp_path, override, key):
    a_file = tmp_path / "taken"
    a_file.write_text("someone's file\n")
    output = tmp_path / "out"
    result = sagegrpo("run", str(DEMO), f"run.output_dir={output}", override.format(file=a_file), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sagegrpo: error: {key} ") and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert a_file.read_text() == "someone's file\n"
    written = [path for path in tmp_path.rglob("*") if path.is_file() and path != a_file]
    assert written == [], written


# --- Prompt lines --------------------------------------------------------------------------------------------------

BAD_LINES = {
    "nested-list": '{"prompt": "a", "m": ' + "[" * DEEP + "]" * DEEP + "}",
    "nested-object": '{"prompt": "a", "m": ' + '{"k": ' * DEEP + "1" + "}" * DEEP + "}",
    "nested-whole-line": "[" * DEEP + "]" * DEEP,
    "huge-integer": '{"prompt": "a", "n": ' + "9" * 4301 + "}",  # one past the 4300 digits int() converts
    "huge-negative-integer": '{"prompt": "a", "n": -' + "1" * 5000 + "}",
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_prompt_line_the_json_reader_cannot_take_is_skipped_and_counted(tmp_path, kind):
    lines = [json.dumps({"prompt": "a cat"}), BAD_LINES[kind], json.dumps({"prompt": "a dog", "n": 10**4000})]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    prompts = ingest(DataConfig(source=str(path), eval_fraction=0.0))
    assert [(prompt.text, prompt.line) for prompt in prompts.train] == [("a cat", 1), ("a dog", 3)]
    assert prompts.report.skipped["undecodable"] == [2]


# --- promote against a registry edited by hand -------------------------------------------------------------------

EXAM = {"eval_set.digest": "d" * 64, "eval_set.size": "20", "eval_set.source": "prompts.jsonl"}


def _registry(capsys, tmp_path: Path, rewards: list[str]) -> str:
    """A registry holding model ``m`` with one version per reward tag (v1 champion, the last challenger); what MLflow
    printed creating it is not the CLI's."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    client = MlflowClient(uri)
    client.create_registered_model("m")
    for reward in rewards:
        client.create_model_version("m", str(tmp_path), tags={**EXAM, "metric.eval/reward": reward})
    client.set_registered_model_alias("m", "champion", "1")
    client.set_registered_model_alias("m", "challenger", str(len(rewards)))
    capsys.readouterr()
    return uri


@pytest.mark.parametrize(("rewards", "version"), [(["0.5", "abc"], "2"), (["high", "0.7"], "1"), (["0.5", ""], "2")])
def test_a_metric_tag_that_is_not_a_number_is_one_line_naming_it(capsys, tmp_path, rewards, version):
    uri = _registry(capsys, tmp_path, rewards)
    line = refused_in_one_line(capsys, ["promote", "--model", "m", "--tracking-uri", uri], "metric.eval/reward")
    assert f"version {version}:" in line, line


@pytest.mark.parametrize("alias", ["champion", "challenger"])
def test_an_alias_whose_version_is_gone_is_one_line_naming_it(capsys, tmp_path, alias):
    import sqlite3

    uri = _registry(capsys, tmp_path, ["0.5", "0.7"])
    with sqlite3.connect(tmp_path / "registry.db") as database:  # as another client or a hand edit leaves it
        database.execute("update registered_model_aliases set version = 9 where alias = ?", (alias,))
    line = refused_in_one_line(capsys, ["promote", "--model", "m", "--tracking-uri", uri, "--dry-run"], "version 9")
    assert alias in line, line


def test_promote_against_a_dead_server_is_one_retryable_line_in_seconds(capsys, monkeypatch):
    from sage_grpo.pipeline import cli

    # An environment of this test's own: none of the operator's settings (they would win), none left behind.
    monkeypatch.setattr(os, "environ", {key: value for key, value in os.environ.items() if key not in FAIL_FAST_HTTP})
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    code = cli.main(["promote", "--model", "m", "--tracking-uri", uri, "--dry-run"])
    err = capsys.readouterr().err
    assert code == RetryableStop.exit_code and len(err.strip().splitlines()) == 1, err
    assert f"tracking server {uri} unreachable while promoting" in err
    assert time.monotonic() - started < 60  # MLflow's own retries took 250 s
