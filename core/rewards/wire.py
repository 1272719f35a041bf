"""The reward server's wire format: a scoring request is one safetensors blob, never pickle.

Tensors ``video_0 .. video_{B-1}`` hold the uint8 videos; the safetensors header's string metadata holds the prompts
(JSON), the fps and, when the prompts have other columns, ``columns`` (JSON ``{name: [value per video]}``: the prompt
metadata the server's rewards take as keyword arguments, as in-process rewards do). Responses are JSON
``{"dimensions": {name: [float | null]}}`` (a missing score is null).
A request is data from a client nobody vouched for: ``decode_request`` checks every part of it and raises
``BadRequest`` (one line) for anything that is not a well-formed batch, before any reward sees it.
"""

from __future__ import annotations

import json
import struct
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors import SafetensorError
from safetensors.torch import load, save

from .base import POSITIONAL, Columns, Scores, VideoBatch

CONTENT_TYPE = "application/octet-stream"


class BadRequest(ValueError):
    """A request body that is not a well-formed scoring batch: the client's fault, answered 400."""


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompts: list[str] = Field(min_length=1)
    fps: float = Field(gt=0, allow_inf_nan=False)
    columns: dict[str, list] = {}

    @model_validator(mode="after")
    def _one_value_per_video(self) -> _Metadata:
        for text in [*self.prompts, *self.columns]:
            try:
                text.encode()
            except UnicodeEncodeError:  # a lone surrogate from a JSON escape: no tokenizer or log line takes it
                raise ValueError(f"{text[:40]!r} is not Unicode text") from None
        for name, values in self.columns.items():
            if name in POSITIONAL:
                raise ValueError(f"column {name!r} would shadow the reward's own argument")
            if len(values) != len(self.prompts):
                raise ValueError(f"column {name!r} has {len(values)} values for {len(self.prompts)} prompts")
        return self


class ScoringRequest(NamedTuple):
    videos: VideoBatch
    prompts: list[str]
    columns: Columns


def encode_request(videos: VideoBatch, prompts: list[str], columns: Columns | None = None) -> bytes:
    tensors = {f"video_{index}": video.detach().cpu().contiguous() for index, video in enumerate(videos)}
    metadata = {"prompts": json.dumps(prompts), "fps": repr(float(videos.fps))}
    if columns:
        metadata["columns"] = json.dumps(columns)
    return save(tensors, metadata=metadata)


def decode_request(body: bytes) -> ScoringRequest:
    try:
        tensors = load(body)  # validates the header, dtypes, shapes and offsets against the body's length
    except SafetensorError as error:
        raise BadRequest(f"not a safetensors body: {error}") from None
    metadata = _metadata(body)
    expected = {f"video_{index}" for index in range(len(metadata.prompts))}
    if set(tensors) != expected:
        raise BadRequest(
            f"{len(metadata.prompts)} prompts need tensors video_0..video_{len(expected) - 1}, "
            f"got {sorted(tensors)[:5]}{' ...' if len(tensors) > 5 else ''}"
        )
    frames = [tensors[f"video_{index}"] for index in range(len(metadata.prompts))]
    if any(0 in video.shape for video in frames):
        raise BadRequest("a video has an empty dimension")
    try:
        return ScoringRequest(VideoBatch(frames, metadata.fps), metadata.prompts, metadata.columns)
    except ValueError as error:  # a video that is not uint8 [F, H, W, 3]
        raise BadRequest(str(error)) from None


def _metadata(body: bytes) -> _Metadata:
    # safetensors layout: an 8-byte little-endian header length, then the JSON header with "__metadata__".
    # ``load`` accepted the body, so the header is there and is JSON; its metadata values are strings.
    (header_length,) = struct.unpack("<Q", body[:8])
    raw = json.loads(body[8 : 8 + header_length]).get("__metadata__") or {}
    try:
        return _Metadata(
            prompts=_json_field(raw, "prompts", None), fps=raw.get("fps"), columns=_json_field(raw, "columns", {})
        )
    except ValidationError as error:
        first = error.errors()[0]
        where, message = ".".join(map(str, first["loc"])), first["msg"].removeprefix("Value error, ")
        raise BadRequest(f"metadata {where}: {message}" if where else f"metadata: {message}") from None


def _json_field(raw: dict, name: str, default):
    if name not in raw:
        return default
    try:
        return json.loads(raw[name])
    except RecursionError:  # json's decoder recurses once per nesting level
        raise BadRequest(f"metadata {name!r} is nested too deeply") from None
    except ValueError as error:  # not JSON, or an integer longer than Python converts (4,300 digits)
        raise BadRequest(f"metadata {name!r} is not JSON: {str(error)[:200]}") from None


def encode_response(dimensions: Scores) -> bytes:
    return json.dumps({"dimensions": dimensions}).encode()


def decode_response(body: bytes) -> Scores:
    return json.loads(body)["dimensions"]
