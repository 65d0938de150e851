"""``trainfast eplb``: place MoE experts on GPUs from a loads tensor and summarise the balance."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import logging
import warnings
from pathlib import Path
from typing import Any, Literal

from trainfast._util import check_int, check_output_file, write_atomic
from trainfast.cli._timing import best_of

_NAME = "eplb"
logger = logging.getLogger("trainfast.cli.eplb")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        _NAME, help="balance MoE experts over GPUs (DeepSeek EPLB) from a [layers, experts] loads file")
    parser.add_argument("loads", nargs="?", help="loads [layers, experts]: .pt, .npy or .csv (default: synthetic "
                                                 "DeepSeek-V3-sized lognormal token counts)")
    parser.add_argument("--replicas", type=int, default=None, help="physical experts per layer (default experts + "
                                                                   "12.5%%, rounded up to a multiple of --gpus)")
    parser.add_argument("--groups", type=int, default=8, help="expert groups (default 8)")
    parser.add_argument("--nodes", type=int, default=4, help="server nodes (default 4)")
    parser.add_argument("--gpus", type=int, default=32, help="GPUs (default 32)")
    parser.add_argument("--tie-break", choices=("torch", "stable"), default="torch")
    parser.add_argument("--refine", action="store_true", help="also run refine=True and compare")
    parser.add_argument("--avoid-gpu-duplicates", action="store_true")
    parser.add_argument("--save", metavar="OUT.pt", help="save {phy2log, log2phy, logcnt} with torch.save")
    parser.add_argument("--plot", metavar="OUT.png", help="plot per-GPU load before/after (needs matplotlib)")
    parser.set_defaults(handler=_run_args)


def _run_args(args: argparse.Namespace) -> int:
    return run(args.loads, replicas=args.replicas, groups=args.groups, nodes=args.nodes, gpus=args.gpus,
               tie_break=args.tie_break, refine=args.refine, avoid_gpu_duplicates=args.avoid_gpu_duplicates,
               save=args.save, plot=args.plot)


def load_loads(path: str) -> Any:
    """A [layers, experts] tensor from .pt (a tensor), .npy or .csv (one layer per line)."""
    import numpy as np
    import torch

    import pickle

    suffix = Path(path).suffix.lower()
    if suffix not in (".pt", ".pth", ".npy", ".csv", ".txt"):
        raise ValueError(f"loads must be a .pt, .npy or .csv file (got {path!r})")
    try:
        if suffix in (".pt", ".pth"):
            value = torch.load(path, map_location="cpu", weights_only=True)
        elif suffix == ".npy":
            value = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            with warnings.catch_warnings():  # an empty file: numpy warns on stderr; we raise below
                warnings.simplefilter("ignore", UserWarning)
                value = torch.from_numpy(np.atleast_2d(np.loadtxt(path, delimiter=",")))
            if value.numel() == 0:
                raise ValueError("no numbers in it")
    except OSError:
        raise  # names the file already
    except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        # Parser messages give a line or a byte, never the file: add it.
        raise ValueError(f"loads file {path!r} is malformed: {error}") from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"loads file {path!r} must hold a single tensor (got {type(value).__name__})")
    return value


def synthetic_loads(num_layers: int = 58, num_experts: int = 256, seed: int = 0) -> Any:
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.round(rng.lognormal(6.0, 1.0, size=(num_layers, num_experts))).astype(np.int64))


def _naive_gpu_loads(weight: Any, num_gpus: int) -> Any:
    """Per-GPU loads without EPLB: expert e on GPU e * num_gpus // experts, no replicas."""
    import numpy as np

    w = weight.double().numpy()
    gpu_of = (np.arange(w.shape[1]) * num_gpus) // w.shape[1]
    out = np.zeros((w.shape[0], num_gpus))
    for gpu in range(num_gpus):
        out[:, gpu] = w[:, gpu_of == gpu].sum(-1)
    return out


def run(loads: str | None, *, replicas: int | None, groups: int, nodes: int, gpus: int,
        tie_break: Literal["torch", "stable"] = "torch",
        refine: bool = False, avoid_gpu_duplicates: bool = False, save: str | None = None,
        plot: str | None = None) -> int:
    import numpy as np

    from trainfast import eplb

    # The library's own bound (2^62), checked here so the error names the flag.
    gpus = check_int(gpus, "--gpus", min_value=1, max_value=2**62 - 1)
    groups = check_int(groups, "--groups", min_value=1, max_value=2**62 - 1)
    nodes = check_int(nodes, "--nodes", min_value=1, max_value=2**62 - 1)
    if replicas is not None:
        replicas = check_int(replicas, "--replicas", min_value=1, max_value=2**62 - 1)
    if plot:
        _figure_class()  # fail before any work when the optional dependency is missing
    for option, out in (("--save", save), ("--plot", plot)):  # fail before the work, not after it
        if out:
            check_output_file(option, out)
    weight = load_loads(loads) if loads else synthetic_loads()
    if weight.dim() != 2:
        raise ValueError(f"loads must be 2-D [layers, experts] (got shape {tuple(weight.shape)})")
    num_layers, num_experts = weight.shape
    if replicas is None:
        replicas = -(-(num_experts + num_experts // 8) // gpus) * gpus
    policy = "hierarchical" if groups % nodes == 0 else "global"
    num_replicas = replicas

    def place(refine_plan: bool) -> Any:
        return eplb.rebalance_experts(weight, num_replicas, groups, nodes, gpus, tie_break=tie_break,
                                      refine=refine_plan, avoid_gpu_duplicates=avoid_gpu_duplicates)

    # validates the arguments before anything is printed
    (phy2log, log2phy, logcnt), seconds = best_of(lambda: place(False))
    print(f"eplb: {num_layers} layers x {num_experts} experts -> {replicas} replicas on {gpus} GPUs "
          f"({nodes} nodes, {groups} groups, {policy} policy, tie_break={tie_break})")
    naive = _naive_gpu_loads(weight, gpus)
    after = eplb.gpu_loads(weight, phy2log, logcnt, gpus)
    mean = np.maximum(naive.mean(-1), 1e-30)
    print(f"  placed in {seconds * 1e3:.2f} ms; replicas per expert max {int(logcnt.max())}, "
          f"log2phy {tuple(log2phy.shape)}")
    print(f"  max/mean GPU load (mean over layers): without EPLB {np.mean(naive.max(-1) / mean):.4f}, "
          f"EPLB {eplb.balancedness(weight, phy2log, logcnt, gpus):.4f}")
    refined = None
    if refine:
        refined, refine_seconds = best_of(lambda: place(True))
        print(f"  refine=True: {eplb.balancedness(weight, refined[0], refined[2], gpus):.4f} "
              f"({refine_seconds * 1e3:.2f} ms)")
    if save:
        import torch

        buffer = io.BytesIO()
        torch.save({"phy2log": phy2log, "log2phy": log2phy, "logcnt": logcnt}, buffer)
        write_atomic(save, buffer.getvalue())
        print(f"  saved placement to {save}")
    if plot:
        _plot(plot, naive, after, None if refined is None else eplb.gpu_loads(weight, refined[0], refined[2], gpus))
        print(f"  wrote {plot}")
    return 0


def _figure_class() -> Any:
    """matplotlib's Figure (drawn by its Agg backend when saved as PNG: no display, no pyplot state)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ValueError("--plot needs matplotlib, an optional dependency: pip install 'trainfast[plot]' "
                         "(or pip install matplotlib)") from error
    return Figure


def _plot(path: str, naive: Any, after: Any, refined: Any) -> None:
    """Bar chart of each GPU's peak load (its load over the layer's mean GPU load, max over layers:
    what the slowest GPU costs), written atomically as PNG to ``path``."""
    import io

    import numpy as np


    num_gpus = naive.shape[1]
    fig = _figure_class()(figsize=(max(6.0, num_gpus * 0.25), 3.5))
    ax = fig.add_subplot()
    series = [("without EPLB", naive), ("EPLB", after)] + ([("EPLB + refine", refined)] if refined is not None else [])
    width = 0.8 / len(series)
    for k, (label, loads) in enumerate(series):
        relative = loads / np.maximum(loads.mean(-1, keepdims=True), 1e-30)
        ax.bar([g + k * width for g in range(num_gpus)], relative.max(0), width=width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("GPU")
    ax.set_ylabel("peak load / mean GPU load")
    ax.set_title("per-GPU load, max over layers (1.0 = perfectly balanced)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_atomic(path, buffer.getvalue())


def _python_reference() -> tuple[str, Any] | None:
    """Upstream's rebalance_experts when importable, else the repository's oracle in a source checkout."""
    from trainfast.integrations.eplb import KNOWN_MODULES

    for name in KNOWN_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "rebalance_experts"):
            return name, module.rebalance_experts
    # From a source checkout: beside the package, or (installed into .venv by `make demo`) the cwd.
    candidates = [Path(__file__).resolve().parents[3], Path.cwd()]
    oracle = next((root / "tests" / "reference" / "eplb.py" for root in candidates
                   if (root / "tests" / "reference" / "eplb.py").is_file()), None)
    if oracle is not None:
        spec = importlib.util.spec_from_file_location("_trainfast_eplb_oracle", oracle)
        if spec is not None and spec.loader is not None:  # always, for a .py file
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return "tests/reference oracle (upstream's algorithm)", module.rebalance_experts
    return None


def demo() -> None:
    import torch

    from trainfast import eplb

    weight = synthetic_loads()
    args = (weight, 288, 8, 4, 32)
    print("eplb: DeepSeek-V3 prefill placement, 58 layers x 256 experts -> 288 replicas, 4 nodes x 8 GPUs")
    got, native_s = best_of(lambda: eplb.rebalance_experts(*args), repeats=20)
    _, stable_s = best_of(lambda: eplb.rebalance_experts(*args, tie_break="stable"), repeats=20)
    refined, _ = best_of(lambda: eplb.rebalance_experts(*args, refine=True), repeats=3)
    print(f"  native {native_s * 1e3:.2f} ms (stable mode {stable_s * 1e3:.2f} ms); max/mean GPU load "
          f"{eplb.balancedness(weight, got[0], got[2], 32):.4f}, refine=True "
          f"{eplb.balancedness(weight, refined[0], refined[2], 32):.4f}")
    reference = _python_reference()
    if reference is None:
        print("  (no Python reference importable here: install DeepSeek's eplb.py or run from a source checkout)")
        return
    label, fn = reference
    try:
        expected, python_s = best_of(lambda: fn(*args), repeats=1)
    except TypeError:  # SGLang's signature
        expected, python_s = best_of(lambda: fn(*args, True), repeats=1)
    same = all(torch.equal(a, b) for a, b in zip(got, expected))
    print(f"  vs {label}: python {python_s:.2f} s, {python_s / native_s:,.0f}x faster, identical={same}")
