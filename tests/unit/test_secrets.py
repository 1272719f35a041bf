"""What counts as a secret, how URLs are masked, and how a token is read; then a credential seeded in each position a
config can hold one (a key named like a credential, the user-info of a URI of any scheme under any key, a password
holding ``@``) never leaves the process in clear. Every outlet is checked: ``sagegrpo config``, config.json, MLflow
params, export.json (and so a registered version's artifacts), one-line errors, logs and tracebacks; one real run
greps everything it prints and writes."""

import json
import logging
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from sage_grpo.core import secrets
from sage_grpo.core.errors import UserError
from sage_grpo.core.export import export_full, model_record
from sage_grpo.core.registry import VideoPolicyModel
from sage_grpo.core.secrets import MASK, is_secret_key, mask_process_output, mask_uri, masked_config, read_secret
from sage_grpo.core.tracking import loggable_params
from sage_grpo.pipeline import cli
from sage_grpo.pipeline.config import load_run_config
from tests.helpers import free_port, sagegrpo

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "key",
    [
        "api_key",
        "hf_token",
        "tracking.password",
        "db.passwd",
        "Authorization",
        "oauth",
        "cookie",
        "session_id",
        "aws_secret_access_key",
        "credentials.0",
        "url_sig",
    ],
)
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["sde.sigma_max", "signal", "design", "rollout.group_size", "model.name"])
def test_keys_that_are_not_secrets(key):
    assert not is_secret_key(key)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://mlflow:pa55@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),
        ("http://KEY:SECRET@minio:9000", "http://***@minio:9000"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2Fx&X-Amz-Signature=abc&X-Amz-Expires=60",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60",
        ),
        (
            "https://storage.googleapis.com/b/o?X-Goog-Signature=f00&alt=media",
            "https://storage.googleapis.com/b/o?X-Goog-Signature=***&alt=media",
        ),
        (
            "https://a.blob.core.windows.net/c?sv=1&sig=Zm9v%3D&se=2",
            "https://a.blob.core.windows.net/c?sv=1&sig=***&se=2",
        ),
        ("failed: Authorization: Bearer eyJ.abc.def (401)", "failed: Authorization: Bearer *** (401)"),
        ("s3://bucket/prefix/step-3", "s3://bucket/prefix/step-3"),
        ("http://127.0.0.1:5000/#/experiments?page=2", "http://127.0.0.1:5000/#/experiments?page=2"),
    ],
)
def test_mask_uri_hides_credentials_and_keeps_the_rest(text, shown):
    assert mask_uri(text) == shown


def test_read_secret_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SOME_TOKEN", "t0k3n")
    (tmp_path / "token").write_text("from-file\n")
    assert read_secret("SOME_TOKEN") == "t0k3n"
    assert read_secret(file=tmp_path / "token") == "from-file"
    assert read_secret() is None


@pytest.mark.parametrize(
    "where", [{"env": "UNSET_TOKEN_VAR"}, {"file": "/nonexistent/token"}, {"env": "SOME_TOKEN", "file": "x"}]
)
def test_a_named_secret_that_is_missing_is_a_user_error(where, monkeypatch):
    monkeypatch.setenv("SOME_TOKEN", "t0k3n")
    with pytest.raises(UserError) as refused:
        read_secret(**where, what="reward server token")
    assert "reward server token" in str(refused.value) and "t0k3n" not in str(refused.value)


# --- A seeded credential reaches no outlet -----------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")
FIXTURES = REPO / "tests" / "fixtures"

# A user's model and reward that take credentials (tests/fixtures/user_rewards/credentials.py), with harmless values
# that each position below replaces.
MODEL = ["model.name=user_rewards.credentials:hub_model", "model.kwargs.hf_token=hf_x"]
JUDGE = "user_rewards.credentials:AuthenticatedJudge"


def _judge(**kwargs: str) -> str:
    kwargs = {"url": "http://judge.local/score", "bearer": "b", "api_key": "k", **kwargs}
    return "rewards=" + json.dumps([{"name": JUDGE, "kwargs": kwargs}])


# (override, the secret it seeds). Each secret is distinct, so a leak names its position.
POSITIONS = [
    ("model.kwargs.hf_token=hf_Tok3nS3cretValue", "hf_Tok3nS3cretValue"),
    (_judge(bearer="BearerS3cretValue"), "BearerS3cretValue"),
    (_judge(api_key="ApiK3ySecretValue"), "ApiK3ySecretValue"),
    (_judge(url="http://judge:Url5ecretPw@judge.local/score"), "Url5ecretPw"),
    (_judge(url="https://judge:pw@at@Tail5ecret@judge.local/score"), "pw@at@Tail5ecret"),
    ("s3.endpoint_url=http://AKIA:Mini@Pa55w0@Word9@minio:9000", "Mini@Pa55w0@Word9"),
    ("tracking.tracking_uri=postgresql+psycopg2://mlflow:Pg5ecretPw@db:5432/mlflow", "Pg5ecretPw"),
    ("registry.base_model=https://hub:Hub5ecret@hub.example/org/model", "Hub5ecret"),
]
IDS = [secret for _, secret in POSITIONS]


def _pieces(secret: str) -> list[str]:
    """The secret and each part of it after an ``@``: a rule that stops at the first ``@`` leaks the tail."""
    return [secret, *(part for part in secret.split("@")[1:] if len(part) >= 4)]


def _assert_hidden(secret: str, **outputs: str) -> None:
    for where, text in outputs.items():
        for piece in _pieces(secret):
            assert piece not in text, f"{piece!r} in {where}: {text[:2000]}"


@pytest.fixture(autouse=True)
def user_package_and_fresh_memory(monkeypatch):
    """The fixture package importable, and no secret remembered from an earlier test, so that each test sees its
    own positions masked by rule rather than by a value some other test loaded."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.setattr(secrets, "_remembered", set())


@pytest.mark.parametrize(
    "key", ["bearer", "rewards.0.kwargs.bearer", "model.kwargs.hf_token", "private_key", "jwt", "x_api_key"]
)
def test_keys_named_like_credentials_are_secret(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    ("text", "secret", "kept"),
    [
        ("postgresql://mlflow:pa55word@db:5432/mlflow", "pa55word", "db:5432/mlflow"),
        ("ftp://u:Ftp5ecret@h/", "Ftp5ecret", "h/"),
        ("redis+tls://:R3disPw@cache:6379/0", "R3disPw", "cache:6379/0"),
        ("mongodb+srv://u:M0ngoPw@cluster/db?retryWrites=true", "M0ngoPw", "cluster/db?retryWrites=true"),
        ("http:/user:Collapsed1@host/x.txt does not exist", "Collapsed1", "host/x.txt does not exist"),
        ("https://user:p@ss@w0rd@host:9000/b", "p@ss@w0rd", "host:9000/b"),
        ("'http://AK:SK+/9@127.0.0.1:9/b/k.txt'", "SK+/9", "127.0.0.1:9/b/k.txt"),
        ('{"url": "s3://KEY:S3cr3tKey@bucket/prefix"}', "S3cr3tKey", 'bucket/prefix"}'),
        ("Could not connect to http://BARE_T0KEN@minio:9000", "BARE_T0KEN", "minio:9000"),
    ],
)
def test_uri_user_info_is_masked_in_any_scheme_and_shape(text, secret, kept):
    shown = mask_uri(text)
    assert kept in shown and MASK in shown
    _assert_hidden(secret, shown=shown)


@pytest.mark.parametrize(("override", "secret"), POSITIONS, ids=IDS)
def test_a_seeded_config_shows_its_secret_nowhere(capsys, override, secret):
    argv = [DEMO, *MODEL, _judge(), override]
    assert cli.main(["config", *argv]) == 0
    printed = capsys.readouterr()
    config = load_run_config(argv[0], argv[1:])
    # By rule, not by memory: a secret remembered while loading would otherwise hide a missing rule.
    secrets._remembered.clear()
    record = model_record(config.model.name, pretrained=config.model.pretrained, kwargs=config.model.kwargs)
    outputs = {
        "sagegrpo config": printed.out + printed.err,
        "config.json": json.dumps(masked_config(config)),
        "MLflow params": json.dumps(loggable_params(config)),
        "export.json": json.dumps(record),
    }
    _assert_hidden(secret, **outputs)
    assert MASK in outputs["config.json"] and MASK in outputs["MLflow params"]


def test_the_export_record_masks_credentials_and_keeps_the_rest():
    record = model_record("m", pretrained="https://u:Hub5ecret@hub/x", kwargs={"hf_token": "hf_x", "seed": 3})
    assert record == {"name": "m", "pretrained": f"https://{MASK}@hub/x", "kwargs": {"hf_token": MASK, "seed": 3}}


def test_a_registered_policy_loads_with_its_credential_from_the_environment(tmp_path, monkeypatch):
    """export.json holds ``hf_token: ***``; loading the version must not hand ``***`` to the factory as a token."""
    from user_rewards.credentials import hub_model  # importable once the fixture has put it on the path

    name = "user_rewards.credentials:hub_model"
    record = model_record(name, kwargs={"hf_token": "hf_Tok3nS3cretValue", "seed": 0})
    export_dir = export_full(hub_model("hf_Tok3nS3cretValue").transformer, tmp_path / "export", model=record)
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    policy = VideoPolicyModel()
    policy.load_context(SimpleNamespace(artifacts={"export": str(export_dir)}, model_config={"kind": "full"}))
    assert policy.adapter.hf_token == "hf_from_the_environment"


# A config refused as it is read, quoting a value that holds a secret: (overrides, secret)
REFUSED = [
    (["tracking.tracking_uri=ftp://u:Ftp5ecretPw@h/"], "Ftp5ecretPw"),
    (["tracking.tracking_uri=s3://KEY:S3Secret9@bucket/mlflow"], "S3Secret9"),
    (["s3.endpoint_url=ftp://KEY:Ckpt@Secret9@minio:9000"], "Ckpt@Secret9"),
    (["checkpoint.uri=ftp://KEY:Uri5ecret@host/x"], "Uri5ecret"),
]


@pytest.mark.parametrize(("overrides", "secret"), REFUSED, ids=[secret for _, secret in REFUSED])
def test_a_refused_config_is_one_masked_line(capsys, overrides, secret):
    assert cli.main(["config", DEMO, *overrides]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and len(printed.err.strip().splitlines()) == 1, printed.err
    _assert_hidden(secret, stderr=printed.err)


def test_logs_warnings_and_tracebacks_are_masked_once_the_process_masks_its_output(capsys, monkeypatch):
    monkeypatch.setattr(logging, "_logRecordFactory", logging.getLogRecordFactory())
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    secrets.remember({"model": {"kwargs": {"hf_token": "hf_Rememb3red"}}})
    mask_process_output()
    mask_process_output()  # idempotent: the factory is wrapped once
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(handler.format(record))
    logger = logging.getLogger("probe.secrets")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        logger.info("calling %s with %s", "ftp://u:Log5ecret@h/", {"token": "hf_Rememb3red"})
        try:
            raise ConnectionError("http://u:Trace5ecret@host:1/ refused")
        except ConnectionError:
            logger.exception("failed")
            sys.excepthook(*sys.exc_info())
    finally:
        logger.removeHandler(handler)

    def fails():
        raise ValueError("postgresql://u:Thread5ecret@db/x")

    thread = threading.Thread(target=fails, name="scorer")
    thread.start()
    thread.join()
    # What warnings.showwarning prints (pytest records warnings instead of printing them)
    warned = warnings.formatwarning("retrying https://u:Warn5ecret@minio:9000", UserWarning, "client.py", 1)
    text = "\n".join(records) + capsys.readouterr().err + warned
    assert "ConnectionError" in text and "Traceback" in text and "in thread scorer" in text and "UserWarning" in text
    for secret in ("Log5ecret", "hf_Rememb3red", "Trace5ecret", "Thread5ecret", "Warn5ecret"):
        _assert_hidden(secret, output=text)


@pytest.mark.parametrize(
    ("overrides", "secret", "code", "start"),
    [
        # Path() collapses the source's "//": the error quotes http:/user:...@host
        (["data.source=http://user:Src@Secret9@host/prompts.txt"], "Src@Secret9", 2, "sagegrpo: error:"),
        # botocore's message quotes the endpoint URL with its user-info; an unreachable store is an outage (75)
        (
            ["data.source=s3://b/k.txt", "s3.endpoint_url=http://AK:End@Secret9@127.0.0.1:{port}/"],
            "End@Secret9",
            75,
            "sagegrpo: data.source s3://b/k.txt unavailable:",
        ),
    ],
    ids=["collapsed-source", "s3-endpoint"],
)
def test_a_run_that_fails_reading_its_data_says_so_in_one_masked_line(tmp_path, overrides, secret, code, start):
    port = free_port()
    overrides = [override.format(port=port) for override in overrides]
    fake_keys = {"AWS_ACCESS_KEY_ID": "AKIAPROBE", "AWS_SECRET_ACCESS_KEY": "probe-secret-key"}
    result = sagegrpo("run", DEMO, f"run.output_dir={tmp_path / 'run'}", *overrides, **fake_keys)
    assert result.returncode == code, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(start), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    _assert_hidden(secret, stdout=result.stdout, stderr=result.stderr)


def test_a_run_seeded_with_secrets_everywhere_writes_and_prints_none(tmp_path):
    """One short real run (registering its model, libraries' logs on with -v) holding every position that a
    working run can hold; its stdout, stderr and every file it writes (MLflow's database and artifacts, the
    registered version's export.json, config.json, checkpoints) are grepped for each secret."""
    held = [(override, secret) for override, secret in POSITIONS if not override.startswith("tracking.")]
    judge = _judge(
        url="https://judge:pw@at@Tail5ecret@judge.local/score", bearer="BearerS3cretValue", api_key="ApiK3ySecretValue"
    )
    overrides = [override for override, _ in held if not override.startswith("rewards=")]
    output = tmp_path / "run"
    result = sagegrpo(
        "-v",
        "run",
        DEMO,
        *MODEL,
        judge,
        *overrides,
        f"run.output_dir={output}",
        "run.max_iterations=1",
        "registry.model_name=probe",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    exports = list(output.rglob("export.json"))
    assert len(exports) >= 2, exports  # the run's export and the registered version's copy
    assert all(json.loads(path.read_text())["model"]["kwargs"]["hf_token"] == MASK for path in exports)
    written = b"".join(path.read_bytes() for path in output.rglob("*") if path.is_file())
    for _, secret in held:
        for piece in _pieces(secret):
            assert piece not in result.stdout and piece not in result.stderr, piece
            assert piece.encode() not in written, piece
