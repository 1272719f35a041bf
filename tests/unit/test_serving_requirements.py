"""The registered pyfunc's pip requirements: the libraries it imports, pinned, and nothing of the training stack."""

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sage_grpo.core.registry import serving_requirements

pytestmark = pytest.mark.unit

TRAINING_ONLY = {"deepspeed", "boto3", "botocore", "s3transfer", "matplotlib", "imageio", "psutil"}
# load_context builds the base model (diffusers, transformers, tokenizers) and applies a LoRA export through peft.
PYFUNC_LIBRARIES = {"torch", "diffusers", "transformers", "tokenizers", "peft", "safetensors", "pandas", "numpy"}


def test_requirements_pin_the_pyfunc_libraries_and_no_training_only_one():
    requirements = serving_requirements()
    names = {canonicalize_name(Requirement(requirement).name) for requirement in requirements}
    assert all(len(Requirement(requirement).specifier) == 1 and "==" in requirement for requirement in requirements)
    assert names >= PYFUNC_LIBRARIES
    assert names & TRAINING_ONLY == set()
