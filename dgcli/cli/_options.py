"""The command-line options the commands share (Typer option objects), and what they turn into for
the engines: offload and RPC placement, sampler parameters over the GGUF's defaults, the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from dgcli.cli import _signals
from dgcli.errors import DgError, InvalidParameter
from dgcli.modelfile.header import read_header
from dgcli.modelfile.hparams import sampler_defaults
from dgcli.params import DiffusionParams

ModelOpt = typer.Option(None, "--model", "-m", help="Registry name (`name` or `name:QUANT`, see `dg list`) or a .gguf path. Default: demo.")
YesOpt = typer.Option(False, "--yes", "-y", help="Download a missing registry model without asking.")
ThreadsOpt = typer.Option(None, "--threads", "-t", help="CPU threads (default: 1 for tiny models under 64 MB, else every core).")
GpuOpt = typer.Option(0, "--gpu-layers", "-ngl", help="Layers to offload to the GPU (-1 = all).")
RpcOpt = typer.Option(
    None, "--rpc", metavar="HOST:PORT[,HOST:PORT]",
    help="Spread the model's layers over llama.cpp RPC workers (`dg worker` on each; all layers unless "
         "--gpu-layers says how many). The protocol is unauthenticated: trusted networks only. "
         "DG_RPC_TIMEOUT: seconds a worker may stay silent before dg gives up on it (default 30).")
NCpuMoeOpt = typer.Option(None, "--n-cpu-moe", metavar="N",
                          help="Keep the expert weights of the first N layers in system memory, the rest on the GPU "
                               "(offloads every layer unless --gpu-layers is given).")
CpuMoeOpt = typer.Option(False, "--cpu-moe", help="Keep every layer's expert weights in system memory (--n-cpu-moe all).")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Print where llama.cpp put the weights (GPU/RAM buffers, tensors kept in RAM).")
CtxOpt = typer.Option(None, "--ctx-size", "-c", help="Context size in tokens (0 = the model's training context; default: min(training, 4096)).")

PromptArg = typer.Argument(None, help="The prompt; '-' (or nothing, with piped stdin) reads stdin.", show_default=False)
PromptOpt = typer.Option(None, "--prompt", "-p", help="The prompt (as llama-cli's -p), instead of the argument.", show_default=False)
FileOpt = typer.Option(None, "--file", "-f", help="Read the prompt from this file ('-': stdin).", show_default=False)
SystemOpt = typer.Option(None, "--system", help="A system prompt (through the chat template).", show_default=False)
RawOpt = typer.Option(False, "--raw", help="No chat template: the prompt as it is, after a bos (GGUFs without a template).")
ParseSpecialOpt = typer.Option(
    False, "--parse-special",
    help="Let control-token text in your prompt (<turn|>, <eos>, ...) act as control tokens. For experts: "
         "by default it stays text, so piped text cannot forge turns.")
SeedOpt = typer.Option(None, "--seed", "-s", help="Random seed (canvas init, sampling, renoise); -1 or none: a random one, shown afterwards.", show_default=False)
TempOpt = typer.Option(None, "--temp", help="A constant temperature: sets --t-min and --t-max to this value.", show_default=False)
PaceOpt = typer.Option(0.0, "--pace", help="Seconds each denoising step stays on screen at least (0 = as fast as it runs), to watch a fast model.")
NoLiveOpt = typer.Option(False, "--no-live", help="Plain streaming (automatic when stdout is not a terminal).")
ForceOpt = typer.Option(False, "--force", help="Replace output files that already exist (never an input).")


def sampler_flags(steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold) -> dict:
    return dict(max_denoising_steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
                stability_threshold=stability_threshold, confidence_threshold=confidence_threshold)


StepsOpt = typer.Option(None, "--steps", help="Max denoising steps per canvas (GGUF default: diffusion.eb_max_steps).", show_default=False)
TMinOpt = typer.Option(None, "--t-min", help="Final temperature of the schedule.", show_default=False)
TMaxOpt = typer.Option(None, "--t-max", help="Initial temperature of the schedule.", show_default=False)
EBOpt = typer.Option(None, "--entropy-bound", help="Entropy budget of the accepted prefix per step (speed knob).", show_default=False)
StabOpt = typer.Option(None, "--stability-threshold", help="Steps the argmax canvas must stay unchanged to stop.", show_default=False)
ConfOpt = typer.Option(None, "--confidence-threshold", help="Mean entropy below which the canvas may stop.", show_default=False)
ThinkingOpt = typer.Option("show", "--thinking", help="Thinking channel: show (dimmed) or hide.")


def check_thinking(thinking: str) -> None:
    if thinking not in ("show", "hide"):
        raise DgError(f"invalid --thinking {thinking!r}: must be show or hide")


def resolve_offload(gpu_layers: int, n_cpu_moe: Optional[int], cpu_moe: bool) -> tuple[int, int]:
    """(gpu_layers, n_cpu_moe) for the engines from --gpu-layers / --n-cpu-moe / --cpu-moe.

    Keeping experts in RAM only means something when the rest is offloaded, so --n-cpu-moe and
    --cpu-moe offload every layer unless --gpu-layers says how many."""
    if cpu_moe and n_cpu_moe is not None:
        raise DgError("pass --cpu-moe or --n-cpu-moe N, not both")
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise DgError(f"invalid --n-cpu-moe {n_cpu_moe}: must be an integer >= 0 (--cpu-moe keeps every layer's experts)")
    experts = -1 if cpu_moe else (n_cpu_moe or 0)
    if experts and gpu_layers == 0 and not typed_option("gpu_layers"):
        gpu_layers = -1
    return gpu_layers, experts


def typed_option(name: str) -> bool:
    """Whether the user gave the running command's parameter `name` (e.g. `--gpu-layers 0`), rather than
    it holding its default; False outside a command."""
    try:  # typer >= 0.20 vendors click
        from typer._click.core import ParameterSource
        from typer._click.globals import get_current_context
    except ImportError:  # pragma: no cover - older typer on real click
        from click.core import ParameterSource
        from click.globals import get_current_context
    ctx = get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def rpc_placement(rpc: Optional[str], gpu_layers: int) -> tuple[Optional[list[str]], int]:
    """(RPC workers, layers to offload) from --rpc and --gpu-layers: with workers and no --gpu-layers,
    every layer goes to them."""
    if rpc is None:
        return None, gpu_layers
    from dgcli.runtime import rpc as rpc_backend

    # a worker lost mid-run ends the process from ggml's thread: as a signal would, not leaving a
    # half-written --trace/--output behind or the terminal's cursor hidden
    rpc_backend.exit_process = _signals.exit_now
    return rpc_backend.parse_endpoints(rpc), gpu_layers or (0 if typed_option("gpu_layers") else -1)


def rpc_option(rpc_servers: Optional[list[str]]) -> dict:
    """The engine seams' keyword for RPC workers, passed only when there are some."""
    return {"rpc": rpc_servers} if rpc_servers else {}


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def diffusion_params(path: Path, temp: Optional[float] = None, **flags: Any) -> DiffusionParams:
    """The GGUF's sampler defaults with the user's flags on top, validated (against the file's canvas)
    before any loading. temp: a constant temperature (t_min = t_max), llama-cli's --temp."""
    if temp is not None:
        if flags.get("t_min") is not None or flags.get("t_max") is not None:
            raise DgError("--temp sets both ends of the temperature schedule; pass --temp or --t-min/--t-max, not both")
        flags.update(t_min=temp, t_max=temp)
    header = read_header(path)
    canvas = header.get("diffusion.canvas_length")
    return sampler_defaults(header).replace(**flags).validate(canvas_length=canvas if isinstance(canvas, int) else None)


def check_generation_args(max_new_tokens: int, threads: Optional[int], gpu_layers: int,
                          ctx_size: Optional[int] = None, pace: float = 0.0) -> None:
    from dgcli.runtime.cpu import check_threads
    from dgcli.runtime.model import check_gpu_layers

    if max_new_tokens < 1:
        raise InvalidParameter("max_new_tokens", max_new_tokens, "an integer >= 1")
    check_threads(threads)
    check_gpu_layers(gpu_layers)
    if ctx_size is not None and ctx_size < 0:
        raise InvalidParameter("ctx_size", ctx_size, "0 (the model's training context) or a token count")
    if not 0 <= pace <= 60:
        raise InvalidParameter("pace", pace, "seconds per step between 0 and 60")


def seed_of(seed: Optional[int]) -> int:
    """The run's seed: the user's, or a random one (-1 or none, as llama-cli's -s -1), shown afterwards."""
    from dgcli.engine.rng import resolve_seed

    return resolve_seed(None if seed == -1 else seed)
