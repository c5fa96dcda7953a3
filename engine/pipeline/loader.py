"""Open a GGUF model: metadata -> typed config (through the architecture registry), tokenizer, chat template,
weights on the chosen device in block format; then apply from outside what runs it fast (`prepare`): the card's
expert cache, the decode step's and the prompt chunks' CUDA graphs. Model files build plain models; every model the
engine runs is made by `build`."""

import ctypes
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.experts import prefetch, replay
from engine.experts.policy import ExpertPolicy, build_expert_cache
from engine.gguf.model_config import ModelConfig
from engine.gguf.reader import GGUFFile
from engine.layers import cpu_weights
from engine.models.decoder import DecoderLM
from engine.models.registry import file_config, model_class
from engine.pipeline.cuda_graphs import DecodeGraphs, PromptGraphs, SlotGraphs
from engine.tokenizer import ChatFormatter, Tokenizer
from installer.engine_options import runtime_switches

log = logging.getLogger("strata.engine")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class DeviceError(ValueError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for but no CUDA device is available: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name} is not supported: use cpu, cuda or cuda:N")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"--dtype {name} is not a compute type: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def prepare(model: DecoderLM, experts: ExpertPolicy | None = None, cuda_graphs: bool = True) -> DecoderLM:
    """Apply to a plain model what runs it on its card: the expert cache its routed experts need (CUDA, under
    `experts`), a routing trace where STRATA_ROUTE_TRACE or STRATA_ROUTE_RECORD asks for one, then the decode
    step's CUDA graphs and, where the family allows them, the prompt chunks' graphs
    (STRATA_PROMPT_GRAPHS=0: chunks run eagerly, for comparisons). On the CPU nothing is applied."""
    policy = experts or ExpertPolicy()
    if model.needs_expert_cache:
        model.attach_experts(build_expert_cache(model, policy))
    model.route_trace = replay.attach(model)  # before the graphs: their steps replay (or record) it too
    if model.expert_cache is not None and policy.prefetch != "off" and getattr(model, "fast", False):
        # the fused decode layer issues and takes the prefetches (engine/models/fast_decode.py)
        model.expert_cache.prefetch = prefetch.attach(
            model, policy.prefetch, runtime_switches().prefetch_trace
        )
    if cuda_graphs and model.device.type == "cuda":
        model.graphs = DecodeGraphs(model)
        model.graphs.counts = model.expert_counts  # put back after the warm-up runs of a capture
        if model.graphs.usable and getattr(model, "fast", False):
            # several slots' decode rows in one step (DecoderLM.decode_rows; a split's LocalStage.run_rows)
            model.slot_graphs = SlotGraphs(model)
        if runtime_switches().prompt_graphs and model.supports_prompt_graphs and PromptGraphs.usable(model):
            model.prompt_graphs = PromptGraphs(model)
    return model


def build(
    gf: GGUFFile,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    layers: range | None = None,
    embed: bool = True,
    head: bool = True,
    experts: ExpertPolicy | None = None,
    cuda_graphs: bool = True,
    kv_host_layers: frozenset[int] = frozenset(),
) -> DecoderLM:
    """The family's model of `layers` on `device` (engine.models.registry; the shared decoder otherwise), prepared;
    its caches keep the KV of `kv_host_layers` in host RAM (--kv-resident)."""
    cls = model_class(gf.architecture) or DecoderLM
    model = cls(cfg, gf, device=device, dtype=dtype, layers=layers, embed=embed, head=head)
    model.kv_host_layers = frozenset(kv_host_layers)
    return prepare(model, experts, cuda_graphs)


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile
    config: ModelConfig
    model: DecoderLM
    tokenizer: Tokenizer
    chat: ChatFormatter
    sequences: int = 1  # KV caches the memory was planned for (serve's --parallel)
    context: int = 0  # positions each KV cache holds (--max-context, auto resolved); 0: not planned here

    @property
    def name(self) -> str:
        return self.path.name


def load_model(
    path: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    experts: ExpertPolicy | None = None,
    cuda_graphs: bool = True,
    cpu_weights_mib: int | None = None,
) -> LoadedModel:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cuda" and dev.index is not None:  # Triton launches on the current card (--gpu 1)
        torch.cuda.set_device(dev)
    gf = GGUFFile.open(path)
    tok = Tokenizer.from_metadata(gf.metadata)
    cfg = file_config(gf, tok.vocab_size)
    model = build(gf, cfg, dev, dt, experts=experts, cuda_graphs=cuda_graphs)
    return loaded(path, gf, cfg, tok, model, cpu_weights_mib, str(dev), dt)


def loaded(
    path: str | Path,
    gf: GGUFFile,
    cfg: ModelConfig,
    tok: Tokenizer,
    model: object,
    cpu_weights_mib: int | None,
    where: str,
    dtype: torch.dtype,
) -> LoadedModel:
    """A built model (or split) as the engine serves it: the CPU layers' float copies budgeted, the chat template
    read (the ChatML fallback said), the load logged."""
    cpu_weights.attach(model, cpu_weights_mib)
    chat = ChatFormatter.from_metadata(gf.metadata)
    if chat.is_fallback:
        log.warning("%s has no chat template: using the ChatML fallback template", Path(path).name)
    log.info(
        "loaded %s: %s, %d layers, %s on %s (%s)",
        Path(path).name,
        cfg.arch,
        cfg.n_layer,
        f"{cfg.n_expert} experts (top-{cfg.n_expert_used})" if cfg.is_moe else "dense",
        where,
        str(dtype).removeprefix("torch."),
    )
    release_freed_heap()
    return LoadedModel(Path(path), gf, cfg, model, tok, chat)  # type: ignore[arg-type]


def release_freed_heap() -> None:
    """Give the C heap's freed pages back to the system after a load (glibc only). Building a tokenizer and the
    layers frees much more than it keeps (a 262k vocabulary's 515k merges pass through Python and Rust), and glibc
    holds freed memory in its heap (35 MB after building Gemma 3 270M's tokenizer alone)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library (musl): nothing to do
        pass
