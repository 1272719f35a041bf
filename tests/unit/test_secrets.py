"""What counts as a secret, how URLs are masked, and how a token is read."""

import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.core.secrets import is_secret_key, mask_uri, read_secret

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
