"""pipeline.commands.setup_logging: at the default verbosity a library's INFO stays out of the log, whatever its
logger is named, while the pipeline's own INFO and every warning stay in."""

import logging

import pytest
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from sage_grpo.pipeline.commands import THIRD_PARTY, setup_logging

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh_setup():
    """setup_logging on a root logger without handlers, as in a fresh process (pytest adds its own at each test)."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    libraries = {name: logging.getLogger(name).level for name in THIRD_PARTY}
    verbosities = diffusers_logging.get_verbosity(), transformers_logging.get_verbosity()

    def setup(verbosity: int) -> None:
        root.handlers = []
        setup_logging(verbosity)

    yield setup
    root.handlers, root.level = saved_handlers, saved_level
    for name, level in libraries.items():
        logging.getLogger(name).setLevel(level)
    diffusers_logging.set_verbosity(verbosities[0])
    transformers_logging.set_verbosity(verbosities[1])


def _emitted(name: str, level: int, capsys) -> bool:
    logging.getLogger(name).log(level, "message from %s", name)
    return f"message from {name}" in capsys.readouterr().err


def test_a_library_logger_named_by_its_file_logs_warnings_but_not_info(fresh_setup, capsys):
    fresh_setup(0)
    by_file = "/venv/lib/python3.11/site-packages/huggingface_hub/serialization/_torch.py"

    assert not _emitted(by_file, logging.INFO, capsys)  # it named an export's staging path
    assert _emitted(by_file, logging.WARNING, capsys)
    assert _emitted("sage_grpo.pipeline.recipe", logging.INFO, capsys)
    assert not _emitted("huggingface_hub.file_download", logging.INFO, capsys)


def test_verbose_keeps_every_librarys_info(fresh_setup, capsys):
    fresh_setup(1)

    assert _emitted("/site-packages/huggingface_hub/serialization/_torch.py", logging.INFO, capsys)
