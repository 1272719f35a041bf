"""The reward server's wire format: a scoring request is one safetensors blob, never pickle.

Tensors ``video_0 .. video_{B-1}`` hold the uint8 videos; the safetensors header's string metadata holds the prompts
(JSON) and the fps. Responses are JSON ``{"dimensions": {name: [float | null]}}`` (a missing score is null).
"""

from __future__ import annotations

import json
import struct

from safetensors.torch import load, save

from .base import Scores, VideoBatch

CONTENT_TYPE = "application/octet-stream"


def encode_request(videos: VideoBatch, prompts: list[str]) -> bytes:
    tensors = {f"video_{index}": video.detach().cpu().contiguous() for index, video in enumerate(videos)}
    return save(tensors, metadata={"prompts": json.dumps(prompts), "fps": repr(float(videos.fps))})


def decode_request(body: bytes) -> tuple[VideoBatch, list[str]]:
    metadata = _metadata(body)
    prompts = json.loads(metadata["prompts"])
    tensors = load(body)
    if sorted(tensors) != sorted(f"video_{index}" for index in range(len(prompts))):
        raise ValueError(f"request holds tensors {sorted(tensors)} for {len(prompts)} prompts")
    frames = [tensors[f"video_{index}"] for index in range(len(prompts))]
    return VideoBatch(frames, float(metadata["fps"])), prompts


def _metadata(body: bytes) -> dict[str, str]:
    # safetensors layout: an 8-byte little-endian header length, then the JSON header with "__metadata__".
    (header_length,) = struct.unpack("<Q", body[:8])
    return json.loads(body[8:8 + header_length])["__metadata__"]


def encode_response(dimensions: Scores) -> bytes:
    return json.dumps({"dimensions": dimensions}).encode()


def decode_response(body: bytes) -> Scores:
    return json.loads(body)["dimensions"]
