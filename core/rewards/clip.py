"""CLIPScore and PickScore: image-text similarity of a CLIP model, averaged over frames sampled from each video.

The paper reports both as evaluation metrics next to VideoAlign; they are also usable as rewards. A video's score is
the mean of its frames' scores, each frame compared with the prompt.
- CLIPScore (Hessel et al., 2021): ``w * max(cos(image, text), 0)`` with w = 2.5, on an OpenAI CLIP model.
- PickScore (Kirstain et al., 2023): ``logit_scale.exp() * cos(image, text)`` on the PickScore_v1 CLIP-H model,
  whose preprocessing is that of laion/CLIP-ViT-H-14-laion2B-s32B-b79K.
"""

from __future__ import annotations

from sage_grpo.core.lazy import lazy_module, no_grad

from .base import Scores, VideoBatch
from .frames import uniform_frame_indices

torch = lazy_module("torch", globals())
F = lazy_module("torch.nn.functional", globals())

CLIPSCORE_WEIGHT = 2.5
DEFAULT_FRAMES = 8


class CLIPSimilarity:
    """Per-frame cosine between CLIP image and text embeddings, turned into a score by ``kind``.

    ``kind`` is ``"clipscore"`` or ``"pickscore"``; the reward reports one dimension of that name.
    """

    def __init__(self, model, tokenizer, image_processor, *, kind: str, num_frames: int = DEFAULT_FRAMES):
        if kind not in ("clipscore", "pickscore"):
            raise ValueError(f"kind must be 'clipscore' or 'pickscore', got {kind!r}")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.kind, self.num_frames = kind, num_frames

    def setup(self, device: torch.device | str) -> None:
        self.model.to(device)

    @property
    def device(self) -> torch.device:
        return self.model.logit_scale.device

    @no_grad
    def __call__(self, videos: VideoBatch, prompts: list[str]) -> Scores:
        text_embeddings = self._text_embeddings(prompts)
        scores = []
        for video, text_embedding in zip(videos, text_embeddings, strict=True):
            cosine = self._frame_embeddings(video) @ text_embedding
            scores.append(self._frame_scores(cosine).mean().item())
        return {self.kind: scores}

    def _frame_scores(self, cosine: torch.Tensor) -> torch.Tensor:
        if self.kind == "clipscore":
            return CLIPSCORE_WEIGHT * cosine.clamp(min=0)
        return self.model.logit_scale.exp().float() * cosine

    def _text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        max_length = self.model.config.text_config.max_position_embeddings
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        features = self.model.get_text_features(**tokens.to(self.device)).pooler_output
        return F.normalize(features.float(), dim=-1)

    def _frame_embeddings(self, video: torch.Tensor) -> torch.Tensor:
        frames = video[uniform_frame_indices(len(video), min(self.num_frames, len(video)))]
        pixels = self.image_processor(images=list(frames.cpu().numpy()), return_tensors="pt")["pixel_values"]
        features = self.model.get_image_features(pixel_values=pixels.to(self.device, self.model.dtype)).pooler_output
        return F.normalize(features.float(), dim=-1)


def _load(model_dir: str, processor_dir: str | None, kind: str, num_frames: int, dtype: str) -> CLIPSimilarity:
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    processor_dir = processor_dir or model_dir
    model = CLIPModel.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return CLIPSimilarity(
        model,
        AutoTokenizer.from_pretrained(processor_dir),
        AutoImageProcessor.from_pretrained(processor_dir),
        kind=kind,
        num_frames=num_frames,
    )


def load_clipscore(model: str, *, num_frames: int = DEFAULT_FRAMES, dtype: str = "float32") -> CLIPSimilarity:
    """CLIPScore from a local CLIP directory (e.g. openai/clip-vit-large-patch14)."""
    return _load(model, None, "clipscore", num_frames, dtype)


def load_pickscore(
    model: str, processor: str | None = None, *, num_frames: int = DEFAULT_FRAMES, dtype: str = "float32"
) -> CLIPSimilarity:
    """PickScore from local directories: the PickScore_v1 model and, if separate, its CLIP-H processor."""
    return _load(model, processor, "pickscore", num_frames, dtype)


# ----------------------------------------------------------------------------------------------------------------
# Tiny random builds for tests
# ----------------------------------------------------------------------------------------------------------------


def _tiny_parts(seed: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, PreTrainedTokenizerFast

    words = ["a", "an", "the", "of", "in", "on", "cat", "dog", "red", "blue", "car", "video", "photo", "running", "sky"]
    special = ["[UNK]", "<|startoftext|>", "<|endoftext|>"]
    vocabulary = {token: index for index, token in enumerate(special + words)}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[
            ("<|startoftext|>", vocabulary["<|startoftext|>"]),
            ("<|endoftext|>", vocabulary["<|endoftext|>"]),
        ],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
    )
    end = vocabulary["<|endoftext|>"]
    config = CLIPConfig(
        text_config={
            "vocab_size": len(vocabulary),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 32,
            "bos_token_id": vocabulary["<|startoftext|>"],
            "eos_token_id": end,
            "pad_token_id": end,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    torch.manual_seed(seed)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return CLIPModel(config), tokenizer, image_processor


def tiny_clipscore(seed: int = 0, num_frames: int = 4) -> CLIPSimilarity:
    """CLIPScore on a tiny random CLIP (32x32 images, word-level tokenizer built in code)."""
    return CLIPSimilarity(*_tiny_parts(seed), kind="clipscore", num_frames=num_frames)


def tiny_pickscore(seed: int = 0, num_frames: int = 4) -> CLIPSimilarity:
    """PickScore on a tiny random CLIP."""
    return CLIPSimilarity(*_tiny_parts(seed), kind="pickscore", num_frames=num_frames)
