"""Stage 1, ingest: prompts from a file (local or S3) to a validated, deduplicated, deterministically split set.

Recipe:
  1. read the source's bytes (a local path or ``s3://bucket/key``) and decode them: UTF-8, or UTF-16/UTF-32 when a
     byte-order mark says so; a file that is mostly not UTF-8, or UTF-16 without a mark (NUL bytes), is refused in
     one line rather than trained on as garbage;
  2. parse it by suffix: ``.txt`` (one prompt per line), ``.jsonl`` or ``.csv`` (a prompt column; every other
     column rides along as the prompt's metadata, which reward functions receive);
  3. skip bad entries (undecodable, empty, whitespace-only, too long) and duplicates, recording each with its line
     number in an ``IngestReport``; no usable prompt at all is a one-line ``UserError``;
  4. split train/eval by a salted hash of each prompt, so the split is the same on every run and every rank and does
     not depend on the order of the file.

Also here, because they serve the prompts this stage produces: ``EmbeddingCache`` (text embeddings on disk, keyed
by encoder and prompt) and ``PromptSampler`` (which prompts each rank rolls out at each iteration, resumable).
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError

from sage_grpo.core.checkpoint_values import SamplerValues, values_problem
from sage_grpo.core.errors import RetryableStop, UserError, first_line, is_outage
from sage_grpo.core.files import atomic_path
from sage_grpo.core.lazy import lazy_module
from sage_grpo.core.models.base import PromptEmbeddings
from sage_grpo.core.s3 import S3Config

torch = lazy_module("torch", globals())

log = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".csv")
SKIP_KINDS = ("undecodable", "empty", "whitespace_only", "too_long", "duplicate")


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    source: str = Field(description="a local path or s3://bucket/key, ending in .txt, .jsonl or .csv")
    prompt_column: str = "prompt"  # .jsonl and .csv only
    max_prompt_chars: int = Field(1000, ge=1)
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    split_salt: str = "sage-grpo"  # change it to draw a different split of the same prompts


@dataclass(frozen=True)
class Prompt:
    text: str  # whitespace-normalised
    metadata: dict[str, Any]  # the entry's other columns, for reward functions
    line: int  # where it starts in the source, 1-based


@dataclass
class IngestReport:
    """Every entry that did not become a prompt, by kind, as source line numbers."""

    kept: int = 0
    skipped: dict[str, list[int]] = field(default_factory=lambda: {kind: [] for kind in SKIP_KINDS})

    def skip(self, kind: str, line: int) -> None:
        self.skipped[kind].append(line)

    @property
    def counts(self) -> dict[str, int]:
        return {kind: len(lines) for kind, lines in self.skipped.items()}

    def summary(self) -> str:
        skipped = ", ".join(f"{count} {kind}" for kind, count in self.counts.items() if count) or "none"
        return f"{self.kept} prompts kept; skipped: {skipped}"


@dataclass
class PromptSet:
    train: list[Prompt]
    eval: list[Prompt]
    report: IngestReport

    def metadata_for(self, ids, split: str = "train") -> list[dict[str, Any]]:
        """The metadata of ``split``'s prompts at ``ids`` (e.g. a rollout's per-sample group ids), in order: what
        ``Scorer.score(..., metadata=...)`` passes to the rewards."""
        prompts = self.train if split == "train" else self.eval
        return [prompts[int(index)].metadata for index in ids]


def ingest(config: DataConfig, s3: S3Config | None = None) -> PromptSet:
    """The whole stage: read, decode, validate, deduplicate, split. An s3:// source is read with ``s3`` (the run's
    ``s3`` section; default: boto3's own configuration)."""
    suffix = _suffix(config.source)
    text = decode(read_source(config, s3), config.source)
    report = IngestReport()
    prompts = _keep_valid_unique(_entries(text, suffix, config.prompt_column, config.source), config, report)
    log.info("ingest %s: %s", config.source, report.summary())
    if not prompts:
        raise UserError(f"{config.source} holds no usable prompt ({report.summary()})")
    held_out = [in_eval_split(p.text, config.split_salt, config.eval_fraction) for p in prompts]
    train = [p for p, out in zip(prompts, held_out) if not out]
    evaluation = [p for p, out in zip(prompts, held_out) if out]
    if not train:
        raise UserError(f"{config.source}: all {len(prompts)} prompts fell in the eval split; lower eval_fraction")
    return PromptSet(train=train, eval=evaluation, report=report)


def _suffix(source: str) -> str:
    suffix = Path(source).suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(f"data.source {source!r} must end in one of {', '.join(SUFFIXES)}")
    return suffix


# --- 1. Reading -------------------------------------------------------------------------------------------------


def read_source(config: DataConfig, s3: S3Config | None = None) -> bytes:
    if config.source.startswith("s3://"):
        return _read_s3(config.source, s3 or S3Config())
    path = Path(config.source)
    if not path.is_file():
        raise UserError(f"data.source {path} does not exist")
    return path.read_bytes()


def _read_s3(uri: str, s3: S3Config) -> bytes:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise UserError(f"data.source {uri!r} is not of the form s3://bucket/key")
    client = s3.client()
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except (ClientError, BotoCoreError) as error:
        if is_outage(error):  # throttled or unreachable past botocore's retries: a later restart reads it
            raise RetryableStop(f"data.source {uri} unavailable: {first_line(error)}") from None
        raise UserError(f"cannot read data.source {uri}: {first_line(error)}") from None


# Byte-order marks of the wide encodings, longest first: UTF-32-LE's mark begins with UTF-16-LE's.
_WIDE_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
# Text in UTF-16 or UTF-32 without a mark has a NUL in every other (or 3 of 4) bytes of ASCII; real UTF-8 prompt
# files have none, so a share this high is an encoding, not a stray corrupt byte (which is skipped with its line).
_NUL_SHARE_OF_WIDE_TEXT = 0.1


def decode(data: bytes, source: str) -> str:
    """The source's text. Bytes that are not UTF-8 survive as lone surrogates (``surrogateescape``), so their lines
    are skipped as undecodable with their line numbers; a file where most lines are like that is refused."""
    for bom, codec in _WIDE_BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec.lower())
            except UnicodeDecodeError as error:
                raise UserError(
                    f"{source} starts with a {codec} byte-order mark but is not valid {codec} "
                    f"(at byte {error.start}); re-save it as UTF-8"
                ) from None
    if data.count(0) > _NUL_SHARE_OF_WIDE_TEXT * len(data):
        raise UserError(
            f"{source} is not UTF-8 text ({data.count(0)} NUL bytes: UTF-16 or UTF-32 without a "
            "byte-order mark?); re-save it as UTF-8"
        )
    text = data.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")
    lines = [line for _, line in _lines(text) if line.strip()]
    broken = [line for line in lines if not _is_valid_utf8(line)]
    if len(broken) * 2 > len(lines):
        raise UserError(
            f"{source} is not UTF-8: {len(broken)} of {len(lines)} lines hold invalid bytes "
            "(another encoding, e.g. Latin-1 or cp1252?); re-save it as UTF-8"
        )
    return text


# --- 2. Parsing: one (line, text | None, metadata) per entry; text None means undecodable ----------------------


Entry = tuple[int, "str | None", dict[str, Any]]


def _entries(text: str, suffix: str, column: str, source: str) -> Iterator[Entry]:
    if suffix == ".txt":
        return _txt_entries(text)
    if suffix == ".jsonl":
        return _jsonl_entries(text, column)
    return _csv_entries(text, column, source)


def _lines(text: str) -> Iterator[tuple[int, str]]:
    # StringIO's universal newlines split on \n, \r\n and \r only, as editors number lines (str.splitlines would also
    # split on form feeds and Unicode separators and shift every later line number).
    for number, line in enumerate(io.StringIO(text, newline=None), start=1):
        yield number, line.rstrip("\n")


def _txt_entries(text: str) -> Iterator[Entry]:
    for number, line in _lines(text):
        yield number, line, {}


def _jsonl_entries(text: str, column: str) -> Iterator[Entry]:
    for number, line in _lines(text):
        if not line.strip():
            yield number, line, {}  # a blank line is an empty entry, not a JSON error
            continue
        try:
            record = json.loads(line)
        # Beyond malformed JSON: nesting past the recursion limit, an integer past Python's 4300-digit conversion
        # limit (a ValueError). Either is one bad line, not the end of the run.
        except (ValueError, RecursionError):
            yield number, None, {}
            continue
        if not isinstance(record, dict) or not isinstance(record.get(column), str):
            yield number, None, {}
            continue
        yield number, record.pop(column), record


def _csv_entries(text: str, column: str, source: str) -> Iterator[Entry]:
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None or column not in header:
        raise UserError(f"{source} has no {column!r} column (header: {header or 'none'})")
    while True:
        first_line = reader.line_num + 1  # a quoted field may span lines: report where the row starts
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error:
            yield first_line, None, {}
            continue
        if not fields:
            yield first_line, "", {}  # a blank line
        elif len(fields) != len(header):
            yield first_line, None, {}  # a missing or extra field: the row cannot be trusted
        else:
            row = dict(zip(header, fields))
            yield first_line, row.pop(column), row


# --- 3. Validation and deduplication ---------------------------------------------------------------------------


def normalise(text: str) -> str:
    """Collapse runs of whitespace to one space and trim: the form prompts are compared, hashed and stored in."""
    return " ".join(text.split())


def _is_valid_utf8(text: str) -> bool:
    # The source was decoded with surrogateescape, so bytes that are not UTF-8 survive as lone surrogates.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _problem(raw: str | None, metadata: dict[str, Any], max_chars: int) -> str | None:
    # Metadata is checked through its JSON text, which reaches strings nested at any depth. A NUL is never text.
    if (
        raw is None
        or "\0" in raw
        or not _is_valid_utf8(raw)
        or not _is_valid_utf8(json.dumps(metadata, ensure_ascii=False))
    ):
        return "undecodable"
    if raw == "":
        return "empty"
    if not raw.strip():
        return "whitespace_only"
    if len(normalise(raw)) > max_chars:
        return "too_long"
    return None


def _keep_valid_unique(entries: Iterator[Entry], config: DataConfig, report: IngestReport) -> list[Prompt]:
    prompts: dict[str, Prompt] = {}
    for line, raw, metadata in entries:
        problem = _problem(raw, metadata, config.max_prompt_chars)
        if problem is None and normalise(raw) in prompts:
            problem = "duplicate"  # the first occurrence is kept
        if problem is None:
            prompts[normalise(raw)] = Prompt(text=normalise(raw), metadata=metadata, line=line)
        else:
            report.skip(problem, line)
    report.kept = len(prompts)
    return list(prompts.values())


# --- 4. Split --------------------------------------------------------------------------------------------------


def in_eval_split(prompt: str, salt: str, eval_fraction: float) -> bool:
    """Whether a prompt is held out for evaluation: a function of the prompt alone, never of its position."""
    digest = hashlib.sha256(f"{salt}\0{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


# --- Text-embedding cache --------------------------------------------------------------------------------------


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class EmbeddingCache:
    """Text embeddings on disk, one safetensors file per (encoder, prompt), so encoders run once per prompt ever.

    Layout: ``root/<sha256(encoder identity)>/<sha256(prompt)>.safetensors``, each file holding one prompt's row of
    every tensor ``encode_fn`` returns. Files are written to a temporary name and renamed, so a reader (another rank,
    or a run restarted after a crash) sees a whole file or none. ``hits`` and ``misses`` count prompts.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.hits = 0
        self.misses = 0

    def get_or_encode(
        self,
        encoder_identity: str,
        prompts: list[str],
        encode_fn: Callable[[list[str]], dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """Batch-first CPU tensors for ``prompts`` in order; only prompts not on disk go through ``encode_fn``.

        Rows are stacked, so every prompt's tensors must have the same shape (encoders padded to a fixed length).
        """
        if not prompts:
            return {}
        directory = self._directory(encoder_identity)
        rows = {prompt: self._load(_row_file(directory, prompt)) for prompt in dict.fromkeys(prompts)}
        missing = [prompt for prompt, row in rows.items() if row is None]
        self.hits += len(rows) - len(missing)
        self.misses += len(missing)
        if missing:
            rows.update(self._encode_and_store(directory, missing, encode_fn))
        names = rows[prompts[0]].keys()
        return {name: torch.stack([rows[prompt][name] for prompt in prompts]) for name in names}

    def _directory(self, encoder_identity: str) -> Path:
        directory = self.root / sha256_hex(encoder_identity)
        label = directory / "encoder.txt"  # the directory name is a hash; this tells a person whose it is
        if not label.exists():
            directory.mkdir(parents=True, exist_ok=True)
            label.write_text(encoder_identity + "\n")
        return directory

    def _load(self, path: Path) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        if not path.exists():
            return None
        try:
            return load_file(path)
        except (SafetensorError, OSError) as error:
            log.warning("embedding cache file %s is unreadable (%s); encoding that prompt again", path, error)
            return None

    def _encode_and_store(
        self, directory: Path, prompts: list[str], encode_fn: Callable[[list[str]], dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        batch = {name: tensor.detach().cpu() for name, tensor in encode_fn(prompts).items()}
        for name, tensor in batch.items():
            if tensor.shape[0] != len(prompts):
                raise ValueError(f"encode_fn returned {name} with {tensor.shape[0]} rows for {len(prompts)} prompts")
        rows = {}
        for index, prompt in enumerate(prompts):
            rows[prompt] = {name: tensor[index] for name, tensor in batch.items()}
            _save_atomically(rows[prompt], _row_file(directory, prompt))
        return rows


def _row_file(directory: Path, prompt: str) -> Path:
    return directory / f"{sha256_hex(prompt)}.safetensors"


def _save_atomically(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as temporary:
        save_file(tensors, temporary)


# --- Distributed prompt sampler --------------------------------------------------------------------------------


class PromptSampler:
    """Which prompt indices each rank takes at each iteration.

    Every iteration takes the next ``prompts_per_rank x world`` indices of one stream and gives rank r the r-th slice,
    so ranks never share a prompt. The stream is a seeded permutation per epoch, so an epoch shows every prompt once.
    An iteration that crosses into the next epoch would take the old epoch's last indices and the new epoch's first
    ones, which can repeat a prompt within one iteration; so the new epoch's order puts the carried-over indices last.

    ``state_dict`` holds the epoch, the position in it and those carried-over indices: enough to rebuild the epoch's
    order exactly, even if the run resumes on a different number of ranks.
    """

    def __init__(self, num_prompts: int, prompts_per_rank: int, rank: int, world: int, seed: int):
        if prompts_per_rank < 1 or not 0 <= rank < world:
            raise ValueError(f"invalid sampler layout: prompts_per_rank={prompts_per_rank}, rank={rank}, world={world}")
        if num_prompts < prompts_per_rank * world:
            raise UserError(
                f"{num_prompts} training prompts cannot fill rollout.prompts_per_rank={prompts_per_rank} on {world} "
                "data-parallel rank(s)"
            )
        self.num_prompts = num_prompts
        self.prompts_per_rank = prompts_per_rank
        self.rank = rank
        self.world = world
        self.seed = seed
        self._start_epoch(epoch=0, carried_over=[])

    def _start_epoch(self, epoch: int, carried_over: list[int]) -> None:
        permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts).tolist()
        later = set(carried_over)
        self.epoch = epoch
        self.position = 0
        self.carried_over = list(carried_over)
        self.order = [i for i in permutation if i not in later] + [i for i in permutation if i in later]

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        needed = self.prompts_per_rank * self.world
        taken = self.order[self.position : self.position + needed]
        self.position += len(taken)
        if len(taken) < needed:
            self._start_epoch(self.epoch + 1, carried_over=taken)
            self.position = needed - len(taken)
            taken += self.order[: self.position]
        start = self.rank * self.prompts_per_rank
        return taken[start : start + self.prompts_per_rank]

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "epoch": self.epoch,
            "position": self.position,
            "carried_over": list(self.carried_over),
        }

    @staticmethod
    def state_problem(state: dict[str, Any], step: int) -> str | None:
        """A position past the prompt set, or a carried-over index outside it (``core.checkpoint_values``)."""
        return values_problem(SamplerValues, state, "sampler")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != self.num_prompts:
            raise UserError(
                f"cannot resume the prompt sampler: the checkpoint saw {state['num_prompts']} prompts, "
                f"the data now has {self.num_prompts}"
            )
        self._start_epoch(state["epoch"], carried_over=state["carried_over"])
        self.position = state["position"]


class CachedEmbeddings:
    """A model adapter's prompt embeddings through the on-disk cache, keyed by (encoder identity, prompt hash):
    ``embeddings(prompts)`` is what the rollout and evaluation stages take."""

    def __init__(self, cache: EmbeddingCache, adapter):
        self.cache, self.adapter = cache, adapter

    def __call__(self, prompts: list[str]) -> PromptEmbeddings:
        rows = self.cache.get_or_encode(self.adapter.encoder_identity, prompts, self._encode_flat)
        device = self.adapter.device
        positive = {k[4:]: v.to(device) for k, v in rows.items() if k.startswith("pos.")}
        negative = {k[4:]: v.to(device) for k, v in rows.items() if k.startswith("neg.")} or None
        return PromptEmbeddings(positive, negative)

    def _encode_flat(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeddings = self.adapter.encode_prompts(prompts)
        flat = {f"pos.{k}": v for k, v in embeddings.tensors.items()}
        flat |= {f"neg.{k}": v for k, v in (embeddings.negative or {}).items()}
        return flat
