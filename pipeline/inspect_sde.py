"""``sagegrpo inspect-sde``: per-step noise std, N_t and S_t of each SDE variant on a noise schedule."""

from __future__ import annotations

import json

from sage_grpo.core import plotting, sde
from sage_grpo.core.errors import UserError


def noise_schedule_table(variant: str, steps: int, shift: float, eta: float) -> list[dict]:
    sigmas = sde.flow_match_sigmas(steps, shift)
    stds = sde.noise_stds(variant, sigmas, eta)
    scales = sde.gradient_scales(variant, sigmas, eta)
    factors = sde.balance_factors(variant, sigmas, eta)
    return [
        {
            "step": t,
            "sigma": float(sigmas[t]),
            "sigma_next": float(sigmas[t + 1]),
            "std": float(stds[t]),
            "N_t": None if scales[t].isnan() else float(scales[t]),
            "S_t": float(factors[t]),
        }
        for t in range(steps)
    ]


def render_text(tables: dict[str, list[dict]]) -> str:
    lines = []
    for variant, rows in tables.items():
        lines.append(f"variant {variant}")
        lines.append(f"{'step':>4} {'sigma':>9} {'sigma_next':>10} {'std':>10} {'N_t':>10} {'S_t':>10}")
        for row in rows:
            n_t = "-" if row["N_t"] is None else f"{row['N_t']:10.4f}"
            lines.append(
                f"{row['step']:>4} {row['sigma']:9.5f} {row['sigma_next']:10.5f} {row['std']:10.5f} {n_t:>10} "
                f"{row['S_t']:10.4f}"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(tables: dict[str, list[dict]], path: str) -> None:
    plt = plotting.pyplot()
    fig, (ax_std, ax_n) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, rows in tables.items():
        steps = [r["step"] for r in rows]
        ax_std.plot(steps, [r["std"] for r in rows], marker="o", label=variant)
        ax_n.plot(steps, [float("nan") if r["N_t"] is None else r["N_t"] for r in rows], marker="o", label=variant)
    ax_std.set(title="noise std per step", xlabel="step", ylabel="std")
    ax_n.set(title="gradient scale N_t = |d mean/d v| / std", xlabel="step", ylabel="N_t", yscale="log")
    for ax in (ax_std, ax_n):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as error:  # a missing folder, no permission, an extension matplotlib cannot write
        raise UserError(f"--plot {path}: {getattr(error, 'strerror', None) or error}") from None
    finally:
        plt.close(fig)


def run(variant: str, steps: int, shift: float, eta: float, as_json: bool, plot_path: str | None) -> str:
    variants = list(sde.VARIANTS) if variant == "all" else [variant]
    tables = {name: noise_schedule_table(name, steps, shift, eta) for name in variants}
    if plot_path:
        plot(tables, plot_path)
    if as_json:
        return json.dumps({"steps": steps, "shift": shift, "eta": eta, "variants": tables}, indent=2)
    return render_text(tables)
