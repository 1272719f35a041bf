"""VideoAlign (VideoReward, KwaiVGI): the frozen reward model of the SAGE-GRPO paper, reimplemented on tensors.

Facts of the released model (arXiv 2501.13918, github.com/KwaiVGI/VideoAlign) this module reproduces:
- Qwen2-VL-2B-Instruct with three added special tokens ``<|VQ_reward|>``, ``<|MQ_reward|>``, ``<|TA_reward|>`` and a
  bias-free linear head (hidden -> 1) read at those three tokens, in that order: visual quality, motion quality,
  text alignment.
- The "detailed_special" prompt template below, with the generation prompt inserted, in Qwen2-VL's chat template,
  preceded by the video.
- Frames sampled uniformly at 2 fps (qwen_vl_utils rules), resized to at most 200704 pixels with sides that are
  multiples of 28; optional normalisation with the released per-dimension mean and std; Overall = VQ + MQ + TA.
- Weights: the base model plus a checkpoint holding a LoRA adapter (merged here at load) and the fully trained
  parameters (reward head, vision tower, token embeddings), saved under the module names of transformers 4.45.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from torch import nn

from .base import Scores, VideoBatch
from .frames import resize_frames, sampled_frame_count, smart_resize, uniform_frame_indices

logger = logging.getLogger(__name__)

REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
DIMENSIONS = ("VQ", "MQ", "TA")
# Released inference_config: raw head outputs are standardised with these before VQ + MQ + TA.
RELEASED_NORMALIZATION = {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}

SAMPLE_FPS = 2.0
MAX_PIXELS = 200704  # 256 * 28 * 28, the released data_config's max_frame_pixels
MIN_PIXELS = 128 * 28 * 28  # qwen_vl_utils' VIDEO_MIN_PIXELS: small videos are upscaled to at least this
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
# OpenAI CLIP statistics, which Qwen2-VL's vision tower was trained with.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

PROMPT_TEMPLATE = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""

VIDEO_PAD = "<|video_pad|>"
# Qwen2-VL's chat template for one user turn holding a video then text, with the default system message and the
# generation prompt, as the released inference applies it.
CHAT_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|>" + VIDEO_PAD + "<|vision_end|>{content}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def chat_text(prompt: str) -> str:
    """The full model input text for one generation prompt, before the video placeholder is expanded."""
    return CHAT_TEMPLATE.format(content=PROMPT_TEMPLATE.format(text_prompt=prompt))


# ----------------------------------------------------------------------------------------------------------------
# Vision preprocessing
# ----------------------------------------------------------------------------------------------------------------


def sample_and_resize(
    video: torch.Tensor,
    video_fps: float,
    *,
    sample_fps: float = SAMPLE_FPS,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> torch.Tensor:
    """uint8 [F, H, W, 3] to the frames the model sees: uint8 [T, 3, H', W'], T even, sides multiples of 28."""
    total_frames, height, width, _ = video.shape
    indices = uniform_frame_indices(total_frames, sampled_frame_count(total_frames, video_fps, sample_fps))
    new_height, new_width = smart_resize(height, width, PATCH_SIZE * MERGE_SIZE, min_pixels, max_pixels)
    return resize_frames(video[indices], new_height, new_width)


def patchify(frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 [T, 3, H, W] to Qwen2-VL's flat patches [t*h*w, 3*2*14*14] and the grid (t, h, w) in patches.

    Pixels are rescaled to [0, 1] and standardised with the CLIP statistics; patches are ordered so that each
    2x2 block of neighbouring patches is contiguous, which the vision tower's patch merger relies on.
    """
    count, channels, height, width = frames.shape
    if count % TEMPORAL_PATCH_SIZE:
        raise ValueError(f"frame count must be a multiple of {TEMPORAL_PATCH_SIZE}, got {count}")
    mean = torch.tensor(IMAGE_MEAN, device=frames.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD, device=frames.device).view(1, 3, 1, 1)
    pixels = (frames.float() / 255.0 - mean) / std
    grid = (count // TEMPORAL_PATCH_SIZE, height // PATCH_SIZE, width // PATCH_SIZE)
    patches = pixels.view(
        grid[0],
        TEMPORAL_PATCH_SIZE,
        channels,
        grid[1] // MERGE_SIZE,
        MERGE_SIZE,
        PATCH_SIZE,
        grid[2] // MERGE_SIZE,
        MERGE_SIZE,
        PATCH_SIZE,
    )
    # -> (t, block row, block col, row in block, col in block, channel, frame in pair, pixel row, pixel col)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(math.prod(grid), channels * TEMPORAL_PATCH_SIZE * PATCH_SIZE**2), grid


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


class VideoRewardModel(nn.Module):
    """Qwen2-VL with VideoReward's linear head, returning raw (VQ, MQ, TA) per video: [B, 3] float32."""

    def __init__(self, vlm: nn.Module, reward_token_ids: list[int]):
        super().__init__()
        self.vlm = vlm
        hidden_size = vlm.config.get_text_config().hidden_size
        self.rm_head = nn.Linear(hidden_size, 1, bias=False, dtype=vlm.dtype)
        self.reward_token_ids = list(reward_token_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values_videos: torch.Tensor,
        video_grid_thw: torch.Tensor,
    ) -> torch.Tensor:
        # Plain 1-D positions, not Qwen2-VL's 3-D M-RoPE: the released reward model's forward passed only embeddings
        # to the text decoder, which then numbered tokens 0..L-1 in all three rotary sections. It was trained and
        # evaluated that way, so its head only gives the released scores under the same positions. (Rows are
        # right-padded, so a row's real tokens are numbered exactly as when scored alone.)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        outputs = self.vlm.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw,
        )
        values = self.rm_head(outputs.last_hidden_state).squeeze(-1).float()
        return torch.stack(
            [values[self._single_position(input_ids, token_id)] for token_id in self.reward_token_ids], dim=1
        )

    @staticmethod
    def _single_position(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
        mask = input_ids == token_id
        if not (mask.sum(dim=1) == 1).all():
            raise ValueError(f"each input must hold reward token {token_id} exactly once (is it in the prompt?)")
        return mask


class VideoAlign:
    """The VideoAlign reward: dimensions VQ, MQ, TA and Overall (= VQ + MQ + TA), higher is better.

    ``normalize`` standardises VQ, MQ and TA with the released statistics (the published numbers, e.g. the
    paper's Overall 0.8066, are normalised). Frames are sampled at ``sample_fps`` from ``videos.fps``.
    """

    default_weights = {"VQ": 0.5, "MQ": 0.5, "TA": 1.0}  # the paper's Setting B

    def __init__(
        self,
        model: VideoRewardModel,
        tokenizer,
        *,
        normalize: bool = True,
        normalization: dict[str, tuple[float, float]] = RELEASED_NORMALIZATION,
        sample_fps: float = SAMPLE_FPS,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
    ):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.normalization = normalization if normalize else None
        self.sample_fps, self.min_pixels, self.max_pixels = sample_fps, min_pixels, max_pixels
        self.video_pad_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)

    def setup(self, device: torch.device | str) -> None:
        self.model.to(device)

    @property
    def device(self) -> torch.device:
        return self.model.rm_head.weight.device

    @torch.no_grad()
    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        raw = self.model(**self.prepare_inputs(videos, prompts))
        scores = {name: raw[:, index] for index, name in enumerate(DIMENSIONS)}
        if self.normalization is not None:
            scores = {
                name: (value - self.normalization[name][0]) / self.normalization[name][1]
                for name, value in scores.items()
            }
        scores["Overall"] = scores["VQ"] + scores["MQ"] + scores["TA"]
        return {name: value.tolist() for name, value in scores.items()}

    def prepare_inputs(self, videos: VideoBatch, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Token ids (right-padded), attention mask, flat patches and patch grids for a batch."""
        token_rows, patches, grids = [], [], []
        for video, prompt in zip(videos, prompts, strict=True):
            frames = sample_and_resize(
                video.to(self.device),
                videos.fps,
                sample_fps=self.sample_fps,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
            )
            video_patches, grid = patchify(frames)
            patches.append(video_patches)
            grids.append(grid)
            token_rows.append(self._token_ids(prompt, math.prod(grid) // MERGE_SIZE**2))
        input_ids, attention_mask = self._pad_right(token_rows)
        return {
            "input_ids": input_ids.to(self.device),
            "attention_mask": attention_mask.to(self.device),
            "pixel_values_videos": torch.cat(patches),
            "video_grid_thw": torch.tensor(grids, device=self.device),
        }

    def _token_ids(self, prompt: str, video_tokens: int) -> list[int]:
        """Tokenise with one video placeholder, then repeat it once per merged patch, as Qwen2-VL's processor does."""
        ids = self.tokenizer(chat_text(prompt))["input_ids"]
        slot = ids.index(self.video_pad_id)
        return ids[:slot] + [self.video_pad_id] * video_tokens + ids[slot + 1 :]

    def _pad_right(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), length), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : len(row)] = torch.tensor(row)
            attention_mask[index, : len(row)] = 1
        return input_ids, attention_mask


# ----------------------------------------------------------------------------------------------------------------
# Loading the released weights
# ----------------------------------------------------------------------------------------------------------------


def load_videoalign(
    base_model: str,
    checkpoint: str,
    *,
    step: int | None = None,
    dtype: str = "bfloat16",
    normalize: bool = True,
    sample_fps: float = SAMPLE_FPS,
    max_pixels: int = MAX_PIXELS,
) -> VideoAlign:
    """VideoAlign from local directories: ``base_model`` holds Qwen2-VL-2B-Instruct, ``checkpoint`` the VideoReward
    release (``model_config.json`` and ``checkpoint-N/`` folders; ``step`` picks N, default the latest).

    Weights load on CPU in ``dtype`` (bf16, as released); ``setup(device)`` moves them to the accelerator.
    """
    from transformers import AddedToken, AutoTokenizer, Qwen2VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(base_model, padding_side="right")
    base_vocabulary = len(tokenizer)
    tokenizer.add_tokens([AddedToken(token, special=True) for token in REWARD_TOKENS], special_tokens=True)
    reward_token_ids = tokenizer.convert_tokens_to_ids(list(REWARD_TOKENS))
    # The checkpoint's embedding rows for the reward tokens sit right after the base vocabulary, in this order.
    if reward_token_ids != list(range(base_vocabulary, base_vocabulary + len(REWARD_TOKENS))):
        raise ValueError(f"reward tokens got ids {reward_token_ids}, expected to follow the base vocabulary")
    vlm = Qwen2VLForConditionalGeneration.from_pretrained(
        base_model, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    vlm.resize_token_embeddings(len(tokenizer))
    model = VideoRewardModel(vlm, reward_token_ids)
    release = read_release_config(Path(checkpoint))
    load_released_weights(model, checkpoint_folder(Path(checkpoint), step), lora_scale(release))
    normalization = release_normalization(release)
    return VideoAlign(
        model, tokenizer, normalize=normalize, normalization=normalization, sample_fps=sample_fps, max_pixels=max_pixels
    )


def read_release_config(checkpoint: Path) -> dict:
    path = checkpoint / "model_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def release_normalization(release: dict) -> dict[str, tuple[float, float]]:
    stats = release.get("inference_config")
    if not stats:
        return RELEASED_NORMALIZATION
    return {name: (float(stats[f"{name}_mean"]), float(stats[f"{name}_std"])) for name in DIMENSIONS}


def lora_scale(release: dict) -> float | None:
    """alpha / r (alpha / sqrt(r) with rsLoRA) from the release's peft_lora_config; None without LoRA."""
    lora = release.get("peft_lora_config", {})
    if not lora.get("lora_enable"):
        return None
    rank, alpha = lora["lora_r"], lora["lora_alpha"]
    return alpha / math.sqrt(rank) if lora.get("use_rslora") else alpha / rank


def checkpoint_folder(checkpoint: Path, step: int | None) -> Path:
    """``checkpoint/checkpoint-<step>`` (the highest step when None), or ``checkpoint`` itself if it holds weights."""
    if step is not None:
        folder = checkpoint / f"checkpoint-{step}"
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} does not exist")
        return folder
    steps = sorted(checkpoint.glob("checkpoint-*"), key=lambda path: int(path.name.rpartition("-")[2]))
    return steps[-1] if steps else checkpoint


def load_released_weights(model: VideoRewardModel, folder: Path, scale: float | None) -> None:
    """Load a VideoReward checkpoint folder into ``model``, merging its LoRA adapter into the base weights.

    Either ``model.pth`` (a full state dict) or ``non_lora_state_dict.pth`` + ``adapter_model.safetensors``.
    Keys are renamed to this module's names; every renamed key must exist in the model, and the reward head must be
    among them, so a layout mismatch fails loudly instead of leaving random weights in place.
    """
    from safetensors.torch import load_file

    full = folder / "model.pth"
    if full.exists():
        released = torch.load(full, map_location="cpu", weights_only=True)
    else:
        released = torch.load(folder / "non_lora_state_dict.pth", map_location="cpu", weights_only=True)
        released.update(load_file(folder / "adapter_model.safetensors"))
    plain = {rename_released_key(key): value for key, value in released.items() if not _is_lora_key(key)}
    lora = {rename_released_key(key): value for key, value in released.items() if _is_lora_key(key)}
    if lora and scale is None:
        raise ValueError(f"{folder} holds LoRA weights but model_config.json enables no LoRA (scale unknown)")
    _check_known_keys(model, plain, folder)
    current = model.state_dict()
    plain.update(merged_lora_weights(lora, current, plain, scale))
    # Only the released weights are loaded (every key was checked above); the rest keeps the base model's values.
    model.load_state_dict({key: value.to(current[key].dtype) for key, value in plain.items()}, strict=False)
    if "vlm.model.language_model.embed_tokens.weight" not in plain:
        logger.warning("%s holds no token embeddings: the reward tokens keep their initial embeddings", folder)


def rename_released_key(key: str) -> str:
    """A key saved by the release (peft-wrapped, transformers 4.45 layout) as a key of ``VideoRewardModel``."""
    key = key.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".default.", ".")
    if key.startswith("rm_head."):
        return key
    for old, new in (
        ("model.embed_tokens.", "model.language_model.embed_tokens."),
        ("model.layers.", "model.language_model.layers."),
        ("model.norm.", "model.language_model.norm."),
        ("visual.", "model.visual."),
    ):
        if key.startswith(old):
            return "vlm." + new + key.removeprefix(old)
    return "vlm." + key


def _is_lora_key(key: str) -> bool:
    return ".lora_" in key


def _check_known_keys(model: nn.Module, plain: dict[str, torch.Tensor], folder: Path) -> None:
    unknown = sorted(set(plain) - set(model.state_dict()))
    if unknown:
        raise ValueError(f"{folder}: {len(unknown)} weights match no parameter, e.g. {unknown[:3]}")
    if "rm_head.weight" not in plain:
        raise ValueError(f"{folder} holds no reward head (rm_head.weight)")


def merged_lora_weights(
    lora: dict[str, torch.Tensor], current: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], scale: float | None
) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for every LoRA pair, computed in float32; W from the checkpoint if it has one."""
    merged = {}
    for key_a in (key for key in lora if ".lora_A." in key):
        module = key_a.partition(".lora_A.")[0]
        weight_key = module + ".weight"
        if weight_key not in current:
            raise ValueError(f"LoRA adapter for {module!r} matches no linear layer")
        base = plain.get(weight_key, current[weight_key]).float()
        delta = lora[module + ".lora_B.weight"].float() @ lora[key_a].float()
        merged[weight_key] = base + scale * delta
    if any(".lora_" in key and ".lora_A." not in key and ".lora_B." not in key for key in lora):
        raise ValueError("only LoRA on linear layers (lora_A / lora_B) is supported")
    return merged


# ----------------------------------------------------------------------------------------------------------------
# Tiny random build for tests
# ----------------------------------------------------------------------------------------------------------------

CHAT_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    VIDEO_PAD,
)


def tiny_tokenizer(reward_tokens: bool = True):
    """A word-level tokenizer built in code: Qwen2-VL's chat and vision tokens, the reward tokens (unless False, as
    in the base model's tokenizer), and the words of the prompt template (other words map to [UNK])."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    splitter = pre_tokenizers.Whitespace()
    words = sorted({word for word, _ in splitter.pre_tokenize_str(chat_text("a video"))})
    special = list(CHAT_SPECIAL_TOKENS) + (list(REWARD_TOKENS) if reward_tokens else [])
    vocabulary = {token: index for index, token in enumerate(["[UNK]"] + special + words)}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = splitter
    backend.add_special_tokens([AddedToken(token, special=True) for token in special])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="<|endoftext|>", padding_side="right"
    )


def tiny_model(tokenizer, seed: int = 0) -> VideoRewardModel:
    """A randomly initialised two-layer Qwen2-VL (hidden 32) with the reward head, in float32."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 8192,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
            "eos_token_id": ids("<|im_end|>"),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )  # as Qwen2-VL-2B: the embedding matrix doubles as the (unused) LM head
    torch.manual_seed(seed)
    vlm = Qwen2VLForConditionalGeneration(config)
    return VideoRewardModel(vlm, ids(list(REWARD_TOKENS)))


def tiny_videoalign(
    normalize: bool = True, seed: int = 0, max_pixels: int = 28 * 28 * 16, min_pixels: int = 28 * 28 * 4
) -> VideoAlign:
    """VideoAlign on a tiny random model: real preprocessing and scoring path, meaningless scores.

    Frames are capped at 16 merged-patch cells (448x448 would be the release's size) to keep CPU tests fast.
    """
    tokenizer = tiny_tokenizer()
    return VideoAlign(
        tiny_model(tokenizer, seed), tokenizer, normalize=normalize, min_pixels=min_pixels, max_pixels=max_pixels
    )
