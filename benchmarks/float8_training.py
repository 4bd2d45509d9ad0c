"""Does a model train in fp8? A small MLP trained 200 steps in bf16 and with each
``nn.Float8Linear`` recipe, from the same weights on the same batches, its loss curves side by side.

    python benchmarks/float8_training.py OUT.json [--steps N]

The task: regress the output of a fixed random teacher of the student's shape (unit-scaled) from
Gaussian inputs, so that the curve tells learning apart from noise. The student (DEPTH linear
layers of WIDTH, GELU between, fp32 master weights, AdamW with a cosine schedule) runs with bf16
activations, every Linear either torch's (its weight cast to bf16 each call) or
``nn.Float8Linear`` (``convert_to_float8``). Writes OUT.json (each run's losses, the mean of the
last 50 and the largest relative gap to bf16's among them) and OUT.png (the curves and the gaps).
"""

from __future__ import annotations

import json
import sys

import torch

from tritonkit import nn
from tritonkit.bench import runner
from tritonkit.ops.float8_linear import RECIPES

WIDTH, DEPTH, BATCH, LR = 2048, 4, 4096, 3e-4


class _Cast(torch.nn.Module):
    """A fp32 master Linear run in bf16 (the weight cast each call), as mixed precision runs it."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return torch.nn.functional.linear(x, self.linear.weight.to(x.dtype))


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for i in range(DEPTH):
        layers.append(torch.nn.Linear(WIDTH, WIDTH, bias=False, device="cuda"))
        if i < DEPTH - 1:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def _batches(steps: int):
    """The same inputs and targets for every run: the teacher's outputs on Gaussian inputs."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    teacher = _mlp(seed=2)
    scale = None  # the first batch's target std, so that the targets have unit scale throughout
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, device="cuda", generator=generator)
        with torch.no_grad():
            target = teacher(x)
            scale = target.std() if scale is None else scale
        yield x.bfloat16(), (target / scale).bfloat16()  # outside no_grad: the caller trains


def _train(recipe: str | None, steps: int) -> list[float]:
    model = _mlp(seed=0)
    if recipe is None:
        for i, layer in enumerate(model):
            if isinstance(layer, torch.nn.Linear):
                model[i] = _Cast(layer)
    else:
        nn.convert_to_float8(model, recipe=recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)  # a smooth tail to compare
    losses = []
    for x, target in _batches(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, gap) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    reference = result["runs"]["bf16"]
    for (name, losses), color in zip(
        result["runs"].items(), plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False
    ):
        curves.plot(losses, label=name, linewidth=1, color=color)
        if name != "bf16":
            gap.plot([a / b - 1 for a, b in zip(losses, reference, strict=True)], linewidth=1, color=color)
    curves.set_yscale("log")
    curves.set_ylabel("MSE loss")
    curves.set_title(f"{DEPTH} x Linear({WIDTH}, {WIDTH}), batch {BATCH}, AdamW {LR} cosine: bf16 and fp8")
    curves.legend()
    gap.axhline(0, color="grey", linewidth=0.5)
    gap.set_ylabel("loss / bf16's - 1")
    gap.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 200
    result = {
        "command": "python benchmarks/float8_training.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "git": runner.provenance()["git_sha"],
        "model": {"width": WIDTH, "depth": DEPTH, "batch": BATCH, "lr": LR, "steps": steps},
        "runs": {},
    }
    for recipe in (None, *RECIPES):
        name = recipe or "bf16"
        result["runs"][name] = _train(recipe, steps)
        print(f"{name}: loss {result['runs'][name][0]:.4f} -> {result['runs'][name][-1]:.4f}", flush=True)
    reference = result["runs"]["bf16"]
    tail = slice(-min(50, steps), None)
    result["tail_mean"] = {name: sum(run[tail]) / len(run[tail]) for name, run in result["runs"].items()}
    result["tail_gap_vs_bf16"] = {
        name: max(abs(a / b - 1) for a, b in zip(run[tail], reference[tail], strict=True))
        for name, run in result["runs"].items()
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
