"""One environment reached by two paths (here a symlink to it) builds DeepSpeed's ops once: the command line imports
the environment's packages through its resolved path, so torch's include paths and DeepSpeed's sources, which torch
writes into each op's build rules, are the same whichever path started the process, and neither path's process sees
the other's build as out of date (they used to rebuild the ops in turn, a minute each on CPU)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

# What torch writes into an op's build.ninja (its include folder) and where DeepSpeed takes the op's sources from,
# after the command line has started (``--version``: it parses its arguments and stops).
BUILD_RULE_PATHS = """
import sys
from sage_grpo.pipeline.cli import program
sys.argv = ["sagegrpo", "--version"]
try:
    program()
except SystemExit:
    pass
from torch.utils.cpp_extension import include_paths
import deepspeed.ops.op_builder.builder as builder
print(include_paths()[0])
print(builder.__file__)
"""


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtual environment to link to")
def test_the_command_line_imports_the_environment_through_its_resolved_path(tmp_path):
    resolved = os.path.realpath(sys.prefix)
    link = tmp_path / "same-environment"
    link.symlink_to(resolved)
    python = link / "bin" / os.path.basename(sys.executable)

    done = subprocess.run(
        [str(python), "-c", BUILD_RULE_PATHS], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )

    assert done.returncode == 0, done.stderr[-3000:]
    torch_include, deepspeed_source = done.stdout.strip().splitlines()[-2:]
    assert torch_include.startswith(resolved + os.sep) and deepspeed_source.startswith(resolved + os.sep)
    assert str(link) not in done.stdout
