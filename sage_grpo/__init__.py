"""sage-grpo: SAGE-GRPO fine-tuning of text-to-video diffusion models.

One installed name, so nothing collides with another distribution's ``core`` or ``pipeline``: the three floors are
``sage_grpo.core`` (foundation), ``sage_grpo.stages`` and ``sage_grpo.pipeline`` (application). An installed wheel
holds them inside this package; a checkout keeps them as top-level folders beside it, found through ``__path__``.
"""

from pathlib import Path

if not (Path(__file__).parent / "core").is_dir():
    __path__.append(str(Path(__file__).resolve().parent.parent))
