"""README.md and docs/ stay true: every command they show is run by a test or by CI, README's config example loads
and validates, its tour names modules that exist, every link between the pages resolves, every config key a page
names is one the schema has, with the default and bound the page gives, and every flag a page shows is an option of
the program it is shown with.

A command is a line of a ```bash, ```sh or ```console block (in a console block, the lines after a ``$`` prompt). A
command that no test can run (a launch on 8 GPUs, a Slurm submission) belongs in a ```text block, said to be an
example. A new command in a shell block fails here until RUN_BY names what runs it.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from torch.distributed import run as torch_run

from sage_grpo.pipeline.cli import build_parser
from sage_grpo.pipeline.config import MOVED_KEYS, RunConfig, load_run_config
from sage_grpo.stages.engine import DEEPSPEED_CONFIGS, load_deepspeed_json

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CI = ROOT / ".ci" / "run"
SHELL_LANGUAGES = {"bash", "sh", "console"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
README_MAX_LINES = 120

# A shown command, or its first words -> what runs it: "FILE::FUNCTION" (a test) or ".ci/run: TEXT" (a CI step; TEXT
# is a line of .ci/run). The longest matching entry answers for a command.
RUN_BY = {
    # scripts/demo.sh: setup.sh, then `sagegrpo run configs/demo.yaml --fresh-start` (checked below), as this test runs.
    "scripts/demo.sh": (
        "tests/integration/test_demo_trust_region.py::test_the_demo_measures_its_trust_region_and_steers_lambda"
    ),
    "scripts/test.sh": ".ci/run: exec scripts/test.sh -q",
    "sagegrpo config configs/demo.yaml": (
        "tests/unit/test_cli.py::test_config_prints_the_validated_config_with_defaults_and_masked_secrets"
    ),
    "sagegrpo env": "tests/unit/test_cli.py::test_env_reports_versions_and_devices",
    "sagegrpo inspect-sde": "tests/unit/test_cli_inspect_sde.py::test_json_output_has_every_step_and_equalized_scales",
    "sagegrpo check-reward": "tests/unit/test_custom_reward_example.py::test_the_example_snippet_passes_check_reward",
    "sagegrpo run configs/demo.yaml": (
        "tests/integration/test_pipeline_run.py::test_demo_single_process_against_mlflow_server"
    ),
    "sagegrpo run configs/demo.yaml --resume auto": (
        "tests/integration/test_resume.py::test_stop_and_resume_equals_the_straight_run"
    ),
    "sagegrpo export configs/demo.yaml --checkpoint auto": (
        "tests/integration/test_resume.py::test_a_checkpoint_exports_as_the_run_end_did_and_another_run_is_refused_the_root"
    ),
    "sagegrpo preflight configs/demo.yaml": (
        "tests/integration/test_preflight.py::test_demo_passes_every_check_and_writes_nothing_into_the_run"
    ),
    "sagegrpo plan": "tests/unit/test_memory_plan.py::test_plan_command_is_registered_with_the_documented_flags",
    "deepspeed --num_gpus 2 --module sage_grpo.pipeline.cli run configs/demo.yaml": (
        "tests/integration/test_pipeline_run.py::test_demo_two_processes_under_the_deepspeed_launcher"
    ),
    "torchrun --nproc-per-node=2 -m sage_grpo.pipeline.cli run configs/demo.yaml": (
        "tests/integration/test_universal_resume.py::test_two_ranks_then_one_then_two_continue_one_run"
    ),
    "kubectl kustomize infra/k8s/overlays/prod": '.ci/run: kubectl kustomize "$overlay"',
}


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(match[1], match[2]) for match in FENCE.finditer(page.read_text())]


def _commands_in(language: str, body: str) -> list[str]:
    lines = body.replace("\\\n", " ").splitlines()
    if language == "console":
        lines = [line.removeprefix("$ ") for line in lines if line.startswith("$ ")]
    return [" ".join(shlex.split(line, comments=True)) for line in lines if shlex.split(line, comments=True)]


def shown_commands() -> list[tuple[str, str]]:
    """(page, command) for every command in a shell block of README.md and docs/*.md."""
    return [
        (page.relative_to(ROOT).as_posix(), command)
        for page in PAGES
        for language, body in _blocks(page)
        if language in SHELL_LANGUAGES
        for command in _commands_in(language, body)
    ]


def runner_of(command: str) -> str | None:
    words = command.split()
    matches = [key for key in RUN_BY if words[: len(key.split())] == key.split()]
    return RUN_BY[max(matches, key=len)] if matches else None


def test_every_shown_command_is_run_by_a_test_or_by_ci():
    commands = shown_commands()
    assert len(commands) >= 10, commands  # the extraction still finds the pages' commands
    unregistered = [f"{page}: {command}" for page, command in commands if runner_of(command) is None]
    assert not unregistered, "register these in RUN_BY with the test that runs them:\n" + "\n".join(unregistered)


@pytest.mark.parametrize("command", sorted(RUN_BY))
def test_each_registered_command_is_shown_and_its_runner_exists(command):
    assert any(runner_of(shown) == RUN_BY[command] for _, shown in shown_commands()), f"{command!r} is shown nowhere"
    runner = RUN_BY[command]
    if runner.startswith(".ci/run: "):
        assert runner.removeprefix(".ci/run: ") in CI.read_text(), runner
        return
    path, function = runner.split("::")
    assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.MULTILINE), runner


def test_readme_shows_the_two_commands_and_ci_runs_its_test_command():
    readme_commands = [command for page, command in shown_commands() if page == "README.md"]
    assert readme_commands == ["scripts/demo.sh", "scripts/test.sh"]
    assert CI.read_text().splitlines()[-1] == "exec scripts/test.sh -q"
    demo = (ROOT / "scripts" / "demo.sh").read_text().splitlines()[-1]
    assert demo == 'exec .venv/bin/sagegrpo run configs/demo.yaml --fresh-start "$@"'  # what RUN_BY's test runs


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_readme_config_example_loads_and_validates(tmp_path):
    (example,) = [body for language, body in _blocks(README) if language == "yaml"]
    path = tmp_path / "example.yaml"
    path.write_text(example)
    config = load_run_config(path)
    assert (config.model.name, config.lora.enabled, config.sde.variant) == ("hunyuan15", True, "sage")
    # What the README says the example leaves to the defaults.
    assert config.trust_region.strategy == "moving"
    assert config.deepspeed.config == "zero3"
    assert config.update.optimizer == "adamw"


def test_the_readme_tour_names_modules_that_exist():
    tour = README.read_text().split("## A tour of the code", 1)[1].split("\n## ", 1)[0]
    floor, named = None, []
    for line in tour.splitlines():
        if heading := re.match(r"`(pipeline|stages|core)/`", line):
            floor = heading[1]
        named += [(floor, name) for name in re.findall(r"`([\w/]+\.py|\w+/)`", line) if floor]
    assert len(named) >= 30, named
    missing = [f"{floor}/{name}" for floor, name in named if not _exists_on_floor(floor, name)]
    assert not missing, missing


def _exists_on_floor(floor: str, name: str) -> bool:
    if name.rstrip("/") in {"pipeline", "stages", "core"}:
        return True
    return any(path.exists() for path in (ROOT / floor / name, *(ROOT / floor).glob(f"*/{name}")))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", linked.read_text()), re.MULTILINE)
            assert anchor in {_anchor(heading) for heading in headings}, f"{page.name}: {target}"


def test_every_repository_path_the_pages_name_exists():
    """A file renamed in the code (a module, a test, a config) cannot leave a page pointing at its old name."""
    roots = {".ci", "benchmarks", "configs", "constraints", "core", "deepspeed_configs", "docs", "examples", "infra"}
    roots |= {"pipeline", "sage_grpo", "scripts", "stages", "tests"}
    missing = [
        f"{page.name}: {token}"
        for page in PAGES
        for token in re.findall(r"`([\w./-]+)`", page.read_text())
        if token.split("/")[0] in roots and "/" in token and not (ROOT / token).exists()
    ]
    assert not missing, missing


# --- Config keys and defaults against the schema ----------------------------------------------------------------

# A dotted name in backticks whose first part is a section (`update.learning_rate`, `rollout.group_size=8`,
# `rewards.0.weights.VQ`); a file name such as `rollout.py` or `run.lock` is not a key.
CONFIG_KEY = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z0-9_]+)+)(?:\s*[:=][^`]*)?`")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "txt", "csv", "lock", "db", "sh", "pt", "safetensors"}
# "`key` (default 3", "`key` updates (default 3", "`key`, default `auto`", "`key` defaults to 0.002", and a table
# row "| `key` | 1.0 | ...".
DEFAULT_IN_PROSE = re.compile(r"`([a-z_][a-z0-9_.]+)`(?: [a-z]+)?,? \(?defaults?(?: to)? `?([^`\s,;:)]+)")
# "`key` (default 3 evaluations, at least 2)" or "(default 2, above 1)": the bound the schema enforces.
BOUND_IN_PROSE = re.compile(r"`([a-z_][a-z0-9_.]+)` \(default [^,()]+, (at\s+least|above) ([^\s,;)]+)")
# A sentence (or list item) that says "default" and gives `key: value` or `key=value`: "The trust region
# (`trust_region.strategy: moving`) ... are the defaults".
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`*])|\n\s*\n|\n\s*- ")
KEY_VALUE = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)(?::\s*|=)([^`]+)`")
DEFAULT_IN_TABLE = re.compile(r"^\| `([a-z_][a-z0-9_.]+)` \| ([^|\s]+)", re.MULTILINE)


def _candidates(annotation) -> list:
    """The types a value of ``annotation`` can take: ``X | None`` gives X and None, ``list[X]`` gives itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [choice for arg in typing.get_args(annotation) for choice in _candidates(arg)]
    return [annotation]


def schema_field(key: str) -> FieldInfo | None:
    """The schema's field ``key`` names (a list index picks an item; free-form data such as ``model.kwargs.*`` gives
    None), or KeyError naming the first part the schema lacks."""
    parts = key.split(".")
    kinds, field = [RunConfig], None
    for depth, part in enumerate(parts):
        below, field = [], None
        for kind in kinds:
            origin = typing.get_origin(kind)
            if kind is typing.Any or kind is dict or origin is dict:
                return None  # below here the schema takes any key
            if origin in (list, tuple) and part.isdigit():
                below += [item for arg in typing.get_args(kind) for item in _candidates(arg)]
            elif isinstance(kind, type) and issubclass(kind, BaseModel) and part in kind.model_fields:
                field = kind.model_fields[part]
                below += _candidates(field.annotation)
        if not below:
            raise KeyError(f"{'.'.join(parts[: depth + 1])}")
        kinds = below
    return field


def named_config_keys() -> list[tuple[str, str]]:
    sections = set(RunConfig.model_fields)
    return sorted(
        {
            (page.name, key)
            for page in PAGES
            for key in CONFIG_KEY.findall(page.read_text())
            if key.split(".")[0] in sections and key.rsplit(".", 1)[1] not in FILE_SUFFIXES and key not in MOVED_KEYS
        }
    )


def test_every_config_key_a_page_names_is_in_the_schema():
    named = named_config_keys()
    assert len(named) >= 60, named  # the pages name over 80: a broken pattern would find none
    unknown = []
    for page, key in named:
        try:
            schema_field(key)
        except KeyError as missing:
            unknown.append(f"{page}: {key} (no {missing.args[0]})")
    assert not unknown, unknown


def _default(field: FieldInfo):
    return field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]


def _said_with_default(text: str) -> list[tuple[str, str]]:
    sentences = SENTENCE.split(FENCE.sub("", text))
    return [
        pair for sentence in sentences if re.search(r"\bdefaults?\b", sentence) for pair in KEY_VALUE.findall(sentence)
    ]


def stated_defaults() -> list[tuple[str, str, str]]:
    return sorted(
        {
            (page.name, key, value)
            for page in PAGES
            for key, value in [
                *(
                    pair
                    for pattern in (DEFAULT_IN_PROSE, DEFAULT_IN_TABLE)
                    for pair in pattern.findall(page.read_text())
                ),
                *_said_with_default(page.read_text()),
            ]
            if key.split(".")[0] in RunConfig.model_fields
        }
    )


def test_every_default_a_page_states_is_the_schemas():
    stated = stated_defaults()
    assert len(stated) >= 5, stated
    wrong = []
    for page, key, value in stated:
        field = schema_field(key)
        assert field is not None, f"{page}: {key} is free-form, it has no default"
        actual, said = _default(field), yaml.safe_load(value)
        if hasattr(actual, "value"):  # an enum member: the YAML spelling is its value
            actual = actual.value
        if isinstance(actual, float) and isinstance(said, str):  # YAML 1.1 reads 1e-5 (no dot) as text
            said = float(said)
        if said != actual:
            wrong.append(f"{page}: {key} default {said!r}, the schema's is {actual!r}")
    assert not wrong, wrong


# --- CLI flags against the parsers ------------------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
# What a flag belongs to: `sagegrpo SUBCOMMAND` (or the module a launcher runs), one of our modules run with
# `python -m`, or another program. The flags after one, up to the next, are its.
PROGRAM = re.compile(
    r"\bsagegrpo(?: (?P<command>[a-z][a-z-]*))?"
    r"|\bsage_grpo\.pipeline\.cli (?P<launched>[a-z][a-z-]*)"
    r"|\bpython -m (?P<module>[\w.]+)"
    r"|\b(?P<other>torchrun|deepspeed|mlflow|sbatch|pytest|ruff|mypy)\b"
)
# Flags of programs that are not ours and whose parser this test does not build (torchrun's it does): each one a
# page names, so a flag a page invents is still caught.
OTHER_FLAGS = {
    "deepspeed": {"--num_gpus", "--module"},
    "mlflow": {"--backend-store-uri", "--artifacts-destination"},
    "sbatch": {"--nodes", "--requeue", "--signal"},
    "pytest": {"--dist"},
    "ruff": {"--check"},
    "mypy": {"--cache-dir"},
}


def _options(parser: argparse.ArgumentParser, *, documented: bool = False) -> set[str]:
    """Its options; ``documented``: only the long ones its ``--help`` shows (not ``--help``, nor a hidden alias)."""
    return {
        option
        for action in parser._actions
        if not documented or (action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction))
        for option in action.option_strings
        if not documented or option.startswith("--")
    }


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (subcommands,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return subcommands.choices


@functools.cache
def sagegrpo_options() -> dict[str | None, set[str]]:
    """Each subcommand's options, and the top level's under None."""
    return {None: _options(build_parser()), **{name: _options(sub) for name, sub in _subcommands().items()}}


def module_options(module: str) -> set[str] | None:
    """The options ``python -m module`` declares (our modules build their parser inside ``main``, so their source
    says), or None when the repository has no such module."""
    path = ROOT / module.removeprefix("sage_grpo.").replace(".", "/")
    sources = [candidate for candidate in (path.with_suffix(".py"), path / "__main__.py") if candidate.exists()]
    return set(re.findall(r"[\"'](--[a-z][a-z0-9_-]*)[\"']", sources[0].read_text())) if sources else None


def program_options(match: re.Match) -> set[str] | None:
    """The options of the program ``match`` names, or None for a subcommand or module the repository lacks."""
    if match["module"]:
        return module_options(match["module"])
    if match["other"] == "torchrun":
        return _options(torch_run.get_args_parser())
    if match["other"]:
        return OTHER_FLAGS[match["other"]]
    return sagegrpo_options().get(match["command"] or match["launched"])


def command_texts(page: Path) -> list[str]:
    """The page's command lines (a ```text synopsis line that starts with ``[`` or ``--`` continues the one before;
    comments cut) and its inline code spans."""
    texts = []
    for _, body in _blocks(page):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#", line, maxsplit=1)[0]
            if texts and re.match(r"\s+(\[|--)", line):
                texts[-1] += line
            elif line.strip():
                texts.append(line)
    return texts + re.findall(r"`([^`\n]+)`", FENCE.sub("", page.read_text()))


def test_every_flag_a_page_shows_is_its_programs():
    """``sagegrpo run --resume auto`` needs ``--resume`` on ``run``; a flag shown alone (``--fresh-start``) needs
    some program the pages run to have it."""
    shown = [(page.name, text) for page in PAGES for text in command_texts(page)]
    known = set().union(*sagegrpo_options().values(), *OTHER_FLAGS.values())
    wrong, alone = [], []
    for page, text in shown:
        invocations = list(PROGRAM.finditer(text))
        if not invocations:
            alone += [(page, flag) for flag in FLAG.findall(text)]
        for match, following in zip(invocations, [*invocations[1:], None]):
            options = program_options(match)
            if options is None:
                wrong.append(f"{page}: {match[0]!r} names no subcommand or module of this repository")
                continue
            known |= options
            after = text[match.end() : following.start() if following else None]
            wrong += [f"{page}: {match[0]!r} has no {flag}" for flag in FLAG.findall(after) if flag not in options]
    assert len(shown) >= 200 and len(alone) >= 10, (len(shown), alone)  # the extraction still finds them
    wrong += [f"{page}: {flag} is no option of any program the pages run" for page, flag in alone if flag not in known]
    assert not wrong, wrong


def test_every_bound_a_page_states_is_the_schemas():
    """ "at least 2" is the field's ``ge``, "above 1" its ``gt``: a page cannot promise a check the schema lacks."""
    stated = sorted({(page.name, *bound) for page in PAGES for bound in BOUND_IN_PROSE.findall(page.read_text())})
    assert len(stated) >= 3, stated
    wrong = []
    for page, key, relation, value in stated:
        constraints = {type(item).__name__: item for item in schema_field(key).metadata}
        kind, attribute = ("Gt", "gt") if relation == "above" else ("Ge", "ge")
        if kind not in constraints or getattr(constraints[kind], attribute) != yaml.safe_load(value):
            wrong.append(f"{page}: {key} {relation} {value}, the schema's constraints are {list(constraints.values())}")
    assert not wrong, wrong


def test_the_synopsis_shows_every_subcommand_with_every_option():
    """docs/commands.md's synopsis is the one list of what the CLI takes: a new subcommand or flag is shown there."""
    synopsis = [text for text in command_texts(ROOT / "docs" / "commands.md") if text.startswith("sagegrpo ")]
    missing = []
    for name, parser in _subcommands().items():
        shown = [text for text in synopsis if text.split()[1] == name]
        flags = set(FLAG.findall(" ".join(shown)))
        missing += [f"sagegrpo {name} {option}" for option in sorted(_options(parser, documented=True) - flags)]
        missing += [] if shown else [f"sagegrpo {name}"]
    assert not missing, missing


def test_the_shipped_deepspeed_configs_are_as_configuration_md_says():
    """Their ZeRO buckets are fixed numbers, not derived from the model (a JSON of one's own may say "auto")."""
    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    said = re.search(r"fix ZeRO's bucket sizes at (\S+) elements \(the persistence threshold at (\S+)\)", text)
    assert said, "configuration.md no longer says what the shipped JSONs fix"
    bucket, threshold = float(said[1]), float(said[2])
    for path in sorted(DEEPSPEED_CONFIGS.glob("*.json")):
        zero = load_deepspeed_json(str(path))["zero_optimization"]
        buckets = {key: zero[key] for key in zero if key.endswith("bucket_size")}
        assert buckets and set(buckets.values()) == {bucket}, (path.name, buckets)
        assert zero.get("stage3_param_persistence_threshold", threshold) == threshold, path.name
