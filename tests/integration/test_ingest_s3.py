"""Stage 1 reading a jsonl prompt set from a real S3 endpoint (moto's standalone server)."""

import json

import boto3
import pytest

from sage_grpo.core.errors import UserError
from sage_grpo.core.s3 import S3Config
from sage_grpo.stages.ingest import DataConfig, ingest

pytestmark = pytest.mark.integration


def test_jsonl_prompts_from_s3(s3_server, s3_bucket):
    lines = [
        json.dumps({"prompt": "a cat surfing", "style": "anime"}),
        "{broken",
        json.dumps({"prompt": "a cat  surfing"}),
        json.dumps({"prompt": "a dog skiing", "style": "real"}),
    ]
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.put_object(Bucket=s3_bucket, Key="prompts/set.jsonl", Body="\n".join(lines).encode())

    prompts = ingest(
        DataConfig(source=f"s3://{s3_bucket}/prompts/set.jsonl", eval_fraction=0.0), S3Config(endpoint_url=s3_server)
    )

    assert [(p.text, p.metadata) for p in prompts.train] == [
        ("a cat surfing", {"style": "anime"}),
        ("a dog skiing", {"style": "real"}),
    ]
    assert prompts.report.skipped["undecodable"] == [2] and prompts.report.skipped["duplicate"] == [3]


def test_missing_s3_object_is_a_one_line_user_error(s3_server, s3_bucket):
    with pytest.raises(UserError, match="cannot read data.source") as error:
        ingest(DataConfig(source=f"s3://{s3_bucket}/absent.jsonl"), S3Config(endpoint_url=s3_server))
    assert "\n" not in str(error.value)
