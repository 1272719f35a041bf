"""sage-grpo: SAGE-GRPO fine-tuning of text-to-video diffusion models.

One installed name, so nothing collides with another distribution's ``core`` or ``pipeline``: the three floors are
``sage_grpo.core`` (foundation), ``sage_grpo.stages`` and ``sage_grpo.pipeline`` (application). An installed wheel
holds them inside this package. A checkout keeps them as top-level folders and links them here
(``sage_grpo/core -> ../core``, and so on), so that the checkout, an editable install and the wheel resolve every
``sage_grpo.*`` name to the same files, for Python as for static tools, and only those names.
"""
