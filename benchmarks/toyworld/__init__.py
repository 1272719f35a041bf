"""ToyWorld: synthetic videos with a known manifold, for measuring what GRPO variants do in minutes on a CPU.

A coloured square moves at constant velocity on a black background; its caption names the colour and direction.
Because every valid video is known, rewards are exact (``rewards.py``) and so is the distance of a generated video to
the nearest valid one (the drift metric, never optimised). ``pretrain.py`` fits a tiny HunyuanVideo 1.5 transformer
to the world; ``compare.py`` runs GRPO with every SDE variant and KL strategy on top of it.
"""
