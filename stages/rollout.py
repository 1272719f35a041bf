"""Stage 2, the rollout: sample G videos per prompt with a stochastic sampler and record every transition.

Recipe, per call of ``generate``:
  1. the sigma schedule from the model's diffusers scheduler (so the deterministic case is the pipeline's own loop);
  2. one prompt encoding per prompt, shared by its group;
  3. every sample gets its own random generator, seeded by (seed, group id, member index): its initial noise and
     every step's noise come from it, so a sample is the same whatever the batch size, order or number of ranks;
  4. batches of samples go through the T denoising steps: velocity, then ``sde.sde_step`` inside the stochastic window
     (Euler outside it), recording latents and log-probs in float32, and which expert made each step (two-expert
     Wan 2.2: the one ``WanPipeline`` runs at that timestep; every scorer checks it runs the same one);
  5. each batch's final latents are decoded to uint8 videos as soon as the batch is done, and handed to ``on_batch``
     (so batch i can be scored, in another thread, while batch i+1 is generated: ``Scorer.overlapped``).

``score_transition`` is the one scorer of a recorded transition: ``recompute_log_probs``, the update's policy, anchor
and lagged forwards and the equalizer diagnostic all call it, and ``SDEConfig.trained_steps_mask`` is the one rule
for which steps train. ``recompute_log_probs`` evaluates the same batches through the same code path as the
rollout, so before any update it reproduces the recorded log-probs
bit for bit: the policy ratio is exactly 1. Other batch compositions (``sample_index``) agree only to float precision,
because matmul and attention kernels change with the batch size (even on CPU: batches of 1 differ from batches of 4
by about 1e-6). Training that needs ratio == 1 exactly must score the rollout's own ``batches``, i.e. use the
rollout's ``batch_size`` as its micro-batch size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sage_grpo.core.lazy import lazy_module, no_grad
from sage_grpo.core.models.base import PromptEmbeddings, VideoModelAdapter
from sage_grpo.core.progress import progress_bar
from sage_grpo.core.sde import (
    SDEStepOutput,
    balance_factors,
    check_eta,
    flow_match_sigmas,
    gaussian_log_prob,
    noise_stds,
    sde_step,
    sliding_window,
)

torch = lazy_module("torch", globals())

T = TypeVar("T")


class RolloutConfig(BaseModel):
    """The ``rollout`` section: G videos per prompt, prompts per rank per iteration."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(4, ge=2, le=1024)  # G: a group of one has no baseline
    prompts_per_rank: int = Field(2, ge=1, le=4096)

    @property
    def samples_per_rank(self) -> int:
        """The videos one rank generates and trains on per iteration: its prompts x G."""
        return self.prompts_per_rank * self.group_size


class SDEConfig(BaseModel):
    """The rollout sampler. Every step is stochastic and trained, the last one included (``final_step``).
    ``window`` = (start, end) makes steps start..end-1 stochastic and the rest deterministic (MixGRPO /
    Flow-GRPO-Fast): a cost lever whose deterministic steps run on the updated weights untrained. ``ode`` samples
    deterministically everywhere.

    Validated when the config loads, before any model: every step's noise std is finite and >= 0 on this schedule
    (a NaN std must never pass for a deterministic step), CPS's eta is at most 1, and some step trains."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    variant: Literal["dance", "flow", "cps", "sage", "ode"] = "sage"
    eta: float = Field(0.5, ge=0, le=2.0)  # beyond 2 every variant's noise swamps the signal (CPS: <= 1)
    steps: int = Field(20, ge=1, le=1000)
    shift: float = Field(5.0, gt=0, le=100.0)
    window: tuple[int, int] | None = None
    # sliding: ``window`` is the position at iteration 0; it moves one step towards low noise every ``window_every``
    # iterations and wraps around (``core.sde.sliding_window``, MixGRPO's progressive window).
    window_schedule: Literal["fixed", "sliding"] = "fixed"
    window_every: int = Field(1, ge=1)
    # The last step (to sigma 0) runs the model like every other: "stochastic" samples it with its own noise and
    # log-prob, so it trains; "deterministic" makes it the Euler step, which never trains yet runs on the updated
    # weights and makes the video (docs/algorithm.md, "Every model-dependent step trains": it undid every update).
    final_step: Literal["stochastic", "deterministic"] = "stochastic"

    @model_validator(mode="after")
    def _valid_schedule(self) -> SDEConfig:
        if self.window is not None:
            start, end = self.window
            if not 0 <= start < end <= self.steps:
                raise ValueError(f"window must satisfy 0 <= start < end <= steps={self.steps}, got {self.window}")
        check_eta(self.sde_variant, self.eta)
        if self.variant != "ode" and not self.trained_steps_mask().any():
            raise ValueError(f"no step of this schedule injects noise (window {self.window}): nothing would train")
        if self.window_schedule == "sliding":
            self._check_sliding()
        return self

    def _check_sliding(self) -> None:
        if self.window is None:
            raise ValueError("sde.window_schedule=sliding needs sde.window=[start, end]: its size and first position")
        sliding_window(self.window, self.steps, 0, self.window_every)
        size = self.window[1] - self.window[0]
        positions = [(start, start + size) for start in range(self.steps - size)]
        counts = {self.model_copy(update={"window": p}).trained_step_count for p in positions}
        if len(counts) > 1:  # the update's accumulation count is set once, from the first position
            raise ValueError(
                f"sde.window_schedule=sliding: a {size}-step window trains {sorted(counts)} steps at different "
                "positions of this schedule (a step without noise does not train); choose another window size"
            )

    def at_iteration(self, iteration: int) -> SDEConfig:
        """The sampler of ``iteration``: this config, with the window moved there when it slides."""
        if self.window_schedule == "fixed":
            return self
        return self.model_copy(update={"window": sliding_window(self.window, self.steps, iteration, self.window_every)})

    @property
    def noisy_final_step(self) -> bool:
        return self.final_step == "stochastic"

    @property
    def sde_variant(self) -> str:
        # With eta = 0 every variant of sde_step is the same Euler step, so 'ode' can borrow any of them.
        return "sage" if self.variant == "ode" else self.variant

    def step_etas(self) -> list[float]:
        """The exploration scale of every step: ``eta`` inside the window, 0 (deterministic) elsewhere."""
        start, end = self.window or (0, self.steps)
        stochastic = self.variant != "ode"
        return [self.eta if stochastic and start <= t < end else 0.0 for t in range(self.steps)]

    def noise_stds(self, sigmas: torch.Tensor | None = None) -> torch.Tensor:
        """[T] float64 noise std of every step, 0 outside the window; ``sigmas`` default to the flow-matching
        schedule, the rollout passes its scheduler's. Raises ValueError on a non-finite or negative std."""
        sigmas = flow_match_sigmas(self.steps, self.shift) if sigmas is None else sigmas
        stds = noise_stds(self.sde_variant, sigmas, self.eta, noisy_final_step=self.noisy_final_step)
        return torch.where(torch.tensor(self.step_etas(), dtype=torch.float64) > 0, stds, 0.0)

    def trained_steps_mask(self, sigmas: torch.Tensor | None = None) -> torch.Tensor:
        """The one rule for which steps train: [T] bool, True on the steps that inject noise inside the window.

        Never a deterministic step: the last one (to sigma 0) with ``final_step=deterministic``, one outside the
        window, or a SAGE step lying wholly above its sigma clamp (no noise): none has a log-prob, so training them
        would only add zero-gradient micro-steps.
        """
        return self.noise_stds(sigmas) > 0

    @property
    def trained_step_count(self) -> int:
        """How many steps of the configured schedule train (``trained_steps_mask``'s count)."""
        return int(self.trained_steps_mask().sum())

    def step_weights(self, sigmas: torch.Tensor | None = None) -> torch.Tensor:
        """[T] float32 S_t, the temporal gradient equalizer's weight of every step's loss: balanced over the trained
        steps, 0 on the others (``sigmas`` as in ``noise_stds``)."""
        sigmas = flow_match_sigmas(self.steps, self.shift) if sigmas is None else sigmas
        trained = self.trained_steps_mask(sigmas)
        return balance_factors(
            self.sde_variant, sigmas, self.eta, trained=trained, noisy_final_step=self.noisy_final_step
        ).float()


@dataclass
class Rollout:
    """N = P x G samples in prompt-major order (sample n renders prompt n // G). Tensors are float32 on the model's
    device except ``videos`` (uint8, CPU) and the index tensors (CPU)."""

    prompts: list[str]  # P prompts; the samples of one prompt form one GRPO group
    embeddings: PromptEmbeddings  # of the P prompts
    sde_config: SDEConfig
    sigmas: torch.Tensor  # [T+1] float32, from 1 to 0; CPU (each step moves its two values to the model's device)
    step_etas: torch.Tensor  # [T] float64 (exactly the config's eta), 0 on deterministic steps; CPU
    stds: torch.Tensor  # [T] float32, the noise std of each step; 0 on deterministic steps; CPU
    trained_steps: torch.Tensor  # [T] bool, CPU: ``trained_steps`` (the config's mask, the trained experts' steps)
    prompt_index: torch.Tensor  # [N] long: position of the sample's prompt in ``prompts`` (its group)
    group_ids: torch.Tensor  # [N] long: the caller's id of that group, part of the sample's seed
    member_index: torch.Tensor  # [N] long: 0..G-1 within the group
    latents: torch.Tensor  # [N, T+1, C, F, H, W]: initial noise, then the latents after every step
    log_probs: torch.Tensor  # [N, T]: log-density of each recorded transition; 0 on deterministic steps
    videos: torch.Tensor | None  # [n, F, H, W, 3] uint8 of ``decoded_samples`` (all N by default), or None
    batches: list[torch.Tensor]  # the sample indices of each transformer batch, in order
    # [T] long, CPU: the expert (``adapter.expert_names``) that made each step; every scorer runs the same one
    experts: torch.Tensor | None = None
    # [N, T, C, F, H, W]: each step's Gaussian mean under the weights that rolled out (``record_means``), or None. The
    # update reads the velocity KL's reference from it when the lagged policy is those weights: no extra forward.
    means: torch.Tensor | None = None
    decoded_batches: slice | None = None  # the ``batches`` whose videos ``videos`` holds; None: all of them

    @property
    def num_samples(self) -> int:
        return self.latents.shape[0]

    @property
    def decoded_samples(self) -> list[int]:
        """The samples whose videos ``videos`` holds, in its order."""
        batches = self.batches if self.decoded_batches is None else self.batches[self.decoded_batches]
        return [int(i) for batch in batches for i in batch]

    @property
    def group_size(self) -> int:
        return self.num_samples // len(self.prompts)

    @property
    def sample_prompts(self) -> list[str]:
        return [self.prompts[i] for i in self.prompt_index.tolist()]

    def sample_embeddings(self, index: torch.Tensor | Sequence[int]) -> PromptEmbeddings:
        """The prompt embeddings of samples ``index``."""
        return self.embeddings.select(self.prompt_index[torch.as_tensor(index, dtype=torch.long)])


@dataclass(frozen=True)
class StepScores:
    log_probs: torch.Tensor  # [n, S]
    means: torch.Tensor  # [n, S, C, F, H, W]


def in_groups(items: Sequence[T], group_size: int) -> list[T]:
    """Each of ``items`` (one per prompt) ``group_size`` times, in the order a rollout lays out its samples: a
    prompt's G samples next to each other, sample n rendering prompt n // G. The one place the layout is written."""
    return [item for item in items for _ in range(group_size)]


def sample_seed(seed: int, group_id: int, member: int) -> int:
    """A 63-bit seed for one sample, stable across runs, machines and Python versions (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}/{group_id}/{member}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@no_grad
def generate(
    adapter: VideoModelAdapter,
    prompts: list[str],
    group_size: int,
    sde_config: SDEConfig,
    seed: int,
    *,
    prompt_ids: Sequence[int] | None = None,
    batch_size: int = 4,
    decode: bool = True,
    progress: bool = True,
    embeddings: PromptEmbeddings | None = None,
    on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    record_means: bool = False,
    decode_batches: slice = slice(None),
) -> Rollout:
    """Roll out ``group_size`` samples for each prompt. ``prompt_ids`` name the groups (default 0..P-1) and must be
    unique across ranks within a step, or two ranks would draw the same samples. ``batch_size`` samples share a
    transformer call; the progress bar shows on rank 0 only. ``on_batch(videos, sample_index)`` receives each batch's
    decoded uint8 videos and their sample indices as soon as the batch is done (sample n renders prompt n // G).
    ``record_means`` keeps every step's Gaussian mean (``Rollout.means``, as large as the latents).
    ``decode_batches`` picks the batches to decode (all by default; a sequence-parallel rank takes its share):
    ``videos`` then holds those batches' samples, ``Rollout.decoded_samples``."""
    if group_size < 1 or batch_size < 1:
        raise ValueError(f"group_size and batch_size must be >= 1, got {group_size} and {batch_size}")
    if on_batch is not None and not decode:
        raise ValueError("on_batch receives decoded videos: it needs decode=True")
    prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")

    sigmas = adapter.sigma_schedule(sde_config.steps, sde_config.shift).cpu()
    stds = sde_config.noise_stds(sigmas)  # raises on a NaN std: never a silently untrained step
    trained = trained_steps(sde_config, adapter, sigmas)
    step_etas = sde_config.step_etas()
    if embeddings is None:  # callers with an embedding cache pass the prompts' embeddings in
        embeddings = adapter.encode_prompts(prompts)

    prompt_index = torch.tensor(in_groups(range(len(prompts)), group_size), dtype=torch.long)
    member_index = torch.arange(group_size).repeat(len(prompts))
    group_ids = torch.as_tensor(prompt_ids, dtype=torch.long)[prompt_index]
    seeds = [sample_seed(seed, int(group), int(member)) for group, member in zip(group_ids, member_index)]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    batches = list(torch.arange(len(prompt_index)).split(batch_size))

    bar = progress_bar(enabled=progress, total=len(batches) * sde_config.steps, desc="rollout", leave=False)
    chains, decoded = [], []
    to_decode = set(range(len(batches))[decode_batches]) if decode else set()
    for number, batch in enumerate(batches):
        chain = _denoise(
            adapter,
            embeddings.select(prompt_index[batch]),
            [generators[i] for i in batch],
            sigmas,
            step_etas,
            sde_config,
            on_step=bar.update,
            record_means=record_means,
        )
        chains.append(chain)
        if number in to_decode:
            decoded.append(adapter.decode(chain["latents"][:, -1]))
            if on_batch is not None:
                on_batch(decoded[-1], batch)
    bar.close()

    latents = torch.cat([c["latents"] for c in chains])
    videos = (torch.cat(decoded) if decoded else torch.empty(0, dtype=torch.uint8)) if decode else None
    return Rollout(
        prompts=list(prompts),
        embeddings=embeddings,
        sde_config=sde_config,
        sigmas=sigmas,
        step_etas=torch.tensor(step_etas, dtype=torch.float64),
        stds=stds.float(),
        trained_steps=trained,
        prompt_index=prompt_index,
        group_ids=group_ids,
        member_index=member_index,
        latents=latents,
        log_probs=torch.cat([c["log_probs"] for c in chains]),
        videos=videos,
        batches=batches,
        experts=adapter.expert_index(sigmas[:-1]),
        means=torch.cat([c["means"] for c in chains]) if record_means else None,
        decoded_batches=decode_batches,
    )


def trained_steps(sde_config: SDEConfig, adapter: VideoModelAdapter, sigmas: torch.Tensor) -> torch.Tensor:
    """[T] bool, the steps the update trains: ``SDEConfig.trained_steps_mask`` on the model's ``sigmas``, less the
    steps of an expert the update does not train (two-expert Wan 2.2 with ``model.train_experts``)."""
    return sde_config.trained_steps_mask(sigmas) & adapter.trained_expert_steps(sigmas)


def check_every_trained_expert_trains(sde_config: SDEConfig, adapter: VideoModelAdapter, sigmas: torch.Tensor) -> None:
    """ValueError when an expert the update trains has no trained step in this schedule: it would take AdamW steps on
    zero gradients (weight decay only), which no one asked for."""
    trained, experts = trained_steps(sde_config, adapter, sigmas), adapter.expert_index(sigmas[:-1])
    for index, name in enumerate(adapter.expert_names):
        if name in adapter.trained_experts and not trained[experts == index].any():
            raise ValueError(
                f"the {name!r} expert is trained (model.train_experts) but no trained step of this schedule is its "
                f"(sde.window {sde_config.window}): leave it out of model.train_experts"
            )


def _denoise(
    adapter, embeddings, generators, sigmas, step_etas, sde_config, on_step, record_means
) -> dict[str, torch.Tensor]:
    """One batch through every step: latents [B, T+1, ...], log_probs [B, T] and, with ``record_means``, means
    [B, T, ...]."""
    x = _per_sample_noise(generators, adapter.latent_shape(), adapter.device)
    latents, log_probs, means = [x], [], []
    for t, eta in enumerate(step_etas):
        sigma, sigma_next = _step_sigmas(sigmas, t, len(x), x.device)
        velocity = adapter.predict_velocity(x, sigma, embeddings)
        # Drawn on deterministic steps too, so that step t's noise does not depend on the window.
        noise = _per_sample_noise(generators, adapter.latent_shape(), adapter.device)
        # sde_step draws from one generator per batch; here each sample has its own, so take the step's Gaussian from
        # sde_step (prev_sample is a placeholder) and sample it ourselves, scoring exactly as sde_step would.
        gaussian = sde_step(
            sde_config.sde_variant,
            velocity,
            x,
            sigma,
            sigma_next,
            eta,
            prev_sample=x,
            noisy_final_step=sde_config.noisy_final_step,
        )
        x = gaussian.mean + gaussian.std * noise
        latents.append(x)
        log_probs.append(gaussian_log_prob(x, gaussian.mean, gaussian.std))
        if record_means:
            means.append(gaussian.mean)
        on_step()
    recorded = {"latents": torch.stack(latents, dim=1), "log_probs": torch.stack(log_probs, dim=1)}
    return recorded | ({"means": torch.stack(means, dim=1)} if record_means else {})


def _per_sample_noise(generators, shape, device) -> torch.Tensor:
    # Drawn on the CPU: the same seed gives the same noise on every device type.
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device)


def _step_sigmas(sigmas: torch.Tensor, t: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sigma and sigma_next of step t on ``device``, shaped [B]: the rollout and every scorer alike."""
    pair = sigmas[t : t + 2].to(device)
    return pair[0].expand(batch), pair[1].expand(batch)


def score_transition(
    adapter: VideoModelAdapter,
    rollout: Rollout,
    samples: torch.Tensor,
    t: int | torch.Tensor,
    *,
    module: torch.nn.Module | None = None,
) -> SDEStepOutput:
    """The Gaussian of step ``t`` of ``samples`` under ``module`` (default: the adapter's transformer) and the
    log-prob of the recorded transition under it: the one scorer of recorded transitions (rollout recompute, the
    update's policy, anchor and lagged forwards, the equalizer diagnostic). Same sigmas, eta and code path as the
    rollout, so on the rollout's own batches and weights it reproduces the recorded log-probs bit for bit.

    ``t`` may be a CPU tensor of one timestep per sample: several (chunk, timestep) pairs in one forward. Their steps
    must share one eta (every trained step does: the config's). Runs under the caller's grad mode; ``samples`` is a
    CPU index tensor, moved to the latents' device here.
    """
    on_device = samples.to(rollout.latents.device)
    if torch.is_tensor(t):
        etas = rollout.step_etas[t].unique()
        if len(etas) != 1:
            raise ValueError(f"timesteps {sorted(set(t.tolist()))} of one forward have different etas {etas.tolist()}")
        steps, eta = t.to(rollout.latents.device), float(etas[0])
        sigma, sigma_next = rollout.sigmas[t].to(on_device.device), rollout.sigmas[t + 1].to(on_device.device)
    else:
        steps, eta = t, float(rollout.step_etas[t])
        sigma, sigma_next = _step_sigmas(rollout.sigmas, t, len(samples), rollout.latents.device)
    _check_expert(adapter, rollout, t, sigma)
    x = rollout.latents[on_device, steps]
    # A view: a node of its own, so differentiating a loss with respect to the velocity stops there and never runs
    # the hooks DeepSpeed or torch attach to the network's output tensor.
    velocity = adapter.predict_velocity(x, sigma, rollout.sample_embeddings(samples), module=module).view_as(x)
    return sde_step(
        rollout.sde_config.sde_variant,
        velocity,
        x,
        sigma,
        sigma_next,
        eta,
        prev_sample=rollout.latents[on_device, steps + 1],
        noisy_final_step=rollout.sde_config.noisy_final_step,
    )


def _check_expert(adapter: VideoModelAdapter, rollout: Rollout, t: int | torch.Tensor, sigma: torch.Tensor) -> None:
    """The transition is scored by the expert that made it: the adapter picks by sigma, so this holds unless the
    model's expert boundary changed since the rollout, which must not pass silently."""
    if rollout.experts is None:
        return
    recorded = rollout.experts[t]
    if not (adapter.expert_index(sigma) == recorded).all():
        raise ValueError(
            f"steps {torch.as_tensor(t).unique().tolist()} were made by expert(s) {recorded.unique().tolist()} of "
            f"{list(adapter.expert_names)}, the model now picks others: its expert boundary changed since the rollout"
        )


def recompute_log_probs(
    adapter: VideoModelAdapter,
    rollout: Rollout,
    steps: Sequence[int],
    sample_index: torch.Tensor | Sequence[int] | None = None,
    module: torch.nn.Module | None = None,
) -> StepScores:
    """Log-probs and means of the recorded transitions at ``steps`` under ``module`` (default: the adapter's
    transformer), for all samples in the rollout's own batches, or for ``sample_index`` as one batch."""
    batches = rollout.batches if sample_index is None else [torch.as_tensor(sample_index, dtype=torch.long)]
    scored = [[score_transition(adapter, rollout, batch, t, module=module) for t in steps] for batch in batches]
    return StepScores(
        log_probs=torch.cat([torch.stack([s.log_prob for s in row], dim=1) for row in scored]),
        means=torch.cat([torch.stack([s.mean for s in row], dim=1) for row in scored]),
    )
