"""The two questions asked of any error (core/errors.py), answered once for every service: is it an outage (S3 and
MLflow alike), and what is its first line, credentials masked."""

import pytest
import requests
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, PERMISSION_DENIED, TEMPORARILY_UNAVAILABLE
from s3transfer.exceptions import RetriesExceededError

from sage_grpo.core.errors import first_line, is_outage

pytestmark = pytest.mark.unit


def s3_answer(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (s3_answer("SlowDown", 503), True),
        (s3_answer("NoSuchBucket", 404), True),  # a bucket being recreated: later can succeed
        (s3_answer("Whatever", 500), True),
        (s3_answer("AccessDenied", 403), False),  # S3 refusing our credentials is a "no"
        (s3_answer("NoSuchKey", 404), False),
        (EndpointConnectionError(endpoint_url="http://minio:9000"), True),
        (RetriesExceededError(last_exception=None), True),
        (NoCredentialsError(), False),
        (MlflowException("down", error_code=TEMPORARILY_UNAVAILABLE), True),
        (MlflowException("who are you", error_code=PERMISSION_DENIED), True),  # tracking tries these again later
        (MlflowException("bad metric", error_code=INVALID_PARAMETER_VALUE), False),
        (requests.ConnectionError("refused"), True),
        (ConnectionRefusedError("refused"), True),
        (TimeoutError(), True),
        (ValueError("no"), False),
        (OSError(28, "No space left on device"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_an_outage_is_a_not_now_of_either_service(error, outage):
    assert is_outage(error) is outage


def test_the_first_line_is_cut_and_masked_and_can_name_the_type():
    error = RuntimeError("cannot reach http://AKIAKEY:TOPSECRET@minio:9000/bucket\ntraceback follows\n" + "x" * 400)
    assert first_line(error) == "cannot reach http://***@minio:9000/bucket"
    assert first_line(error, with_type=True) == "RuntimeError: cannot reach http://***@minio:9000/bucket"
    assert first_line(ValueError("y" * 400)) == "y" * 300
    assert first_line(KeyError()) == "KeyError"


def test_a_credential_across_the_cut_is_masked_not_halved():
    """Masked before it is cut: a cut inside the user-info would leave ``http://KEY:SEC`` with no ``@`` to mask."""
    padding = "x" * (300 - len("http://AKIAKEY:TOP"))
    line = first_line(RuntimeError(padding + "http://AKIAKEY:TOPSECRET@minio:9000/bucket"))
    assert line == (padding + "http://***@minio:9000/bucket")[:300]
