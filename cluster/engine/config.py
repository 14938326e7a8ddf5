"""The engine's configuration: one frozen, validated object."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.engine.request_limits import quote
from cluster.engine.speculative.config import SpeculativeConfig

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class GroupNameError(ValueError):
    pass


def check_name(kind: str, name: str) -> str:
    """A cluster, engine or group name: it names process groups, ports and store prefixes
    (``cluster/parallel/naming.py``), so it is kept to what every one of them accepts."""
    if not _NAME.match(name):
        raise GroupNameError(
            f"{kind} name {name!r} must be 1-63 characters of letters, digits, '-', '_' or '.', starting with a letter or digit"
        )
    return name


CPU_MATMUL_DTYPES = ("auto", "float32", "bfloat16")


class EngineConfigError(ValueError):
    """A setting that cannot work; the message names it."""


CPU_BATCHED_TOKENS = 512
GPU_BATCHED_TOKENS = 2048


def default_batched_tokens(device: str) -> int:
    """A step's token budget where none is set. On a CPU a step of prompt tokens is
    compute-bound well below 512 of them: one thread prefilled a 1,000-token prompt of the
    default model in 2.32-2.39 s with a budget of 256 or 512, 2.44-3.17 s with 2048
    (2026-11-29). A larger budget gains nothing there, and it puts the prompts that waited
    together into one step, which gives the first the last one's TTFT: two 1,000-token prompts
    that met in a prefill worker's queue both had their first token after 7.5-7.9 s, where one
    after the other they have it after 2.5 and 5 s. A GPU's step is not compute-bound that soon."""
    return CPU_BATCHED_TOKENS if str(device).startswith("cpu") else GPU_BATCHED_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs a model.

    ``num_kv_blocks`` fixes the KV cache size; otherwise ``kv_cache_memory_fraction`` of the
    device's memory (the node's RAM on a CPU, a GPU's free memory on CUDA) is the KV budget,
    capped at what ``max_num_seqs`` requests of ``max_model_len`` tokens could ever use.

    The budget is the node's (or the GPU's), not each process's: every rank placed there
    shares it. Each rank of this engine takes ``kv_memory_share`` of it; the disaggregated
    cluster sets that to 1 / (ranks it placed on the rank's node). None: the engine's own
    ranks share the node, 1 / ``tensor_parallel_size`` on a CPU; on CUDA each rank has a GPU
    of its own, so 1.

    ``attention_backend``: ``auto`` (Triton kernels on CUDA, plain torch elsewhere), ``torch``
    or ``triton`` (on a CPU only under ``TRITON_INTERPRET=1``, for tests). ``enforce_eager``
    turns off CUDA graphs for decode steps (on by default with the Triton backend on one
    rank). ``load_format="dummy"`` fills the weights with random values instead of reading
    them (benchmarks on a model's shape). ``quantization``: ``auto`` serves a quantized checkpoint
    as it ships (a GGUF's blocks; a Hugging Face checkpoint's FP8, AWQ or GPTQ tensors) on the
    CPU and on CUDA's Triton backend, ``none`` widens every weight to ``dtype``,
    ``int8``/``int4``/``fp8`` quantize a float checkpoint at load (on CUDA: not with
    ``attention_backend="torch"``; :mod:`cluster.engine.quantization.choice`). ``host_cache``: a
    host tier for the prefix cache's evicted blocks (:mod:`cluster.engine.kv_tiers`), a block count
    or a size (``"512MiB"``); None: off. ``cpu_matmul_dtype``: how the CPU kernel multiplies
    quantized weights: ``float32``, or ``bfloat16`` dot products (weights and activations rounded to
    bfloat16, float32 sums; needs AVX512_BF16) for every quantized weight, or ``auto``: for 4-bit
    weights where the CPU has them (see :meth:`resolved_cpu_matmul_dtype`).
    """

    model: str
    dtype: str | None = None
    device: str = "cpu"
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # None: by device, see default_batched_tokens
    max_num_seqs: int = 128
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.25
    kv_memory_share: float | None = None  # this engine's ranks' part of the node's KV budget (see above)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    cluster_name: str = "tandem"
    engine_name: str = "engine"
    ray_address: str | None = None
    cpus_per_rank: float = 0.25  # Ray CPUs of each tensor-parallel follower rank
    gpus_per_rank: int = 0  # Ray GPUs of each follower rank (0: devices are given by index instead)
    attention_backend: str = "auto"
    enforce_eager: bool = False
    load_format: str = "safetensors"
    quantization: str = "auto"  # see cluster/engine/quantization/choice.py
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), int8 or fp8_e4m3: cluster/engine/quantization/kv_format.py
    cpu_matmul_dtype: str = "auto"  # auto, float32 or bfloat16: see above
    speculative: SpeculativeConfig | None = None  # several tokens per decode step: cluster/engine/speculative
    host_cache: int | str | None = None  # host KV tier: blocks, or a size like "512MiB"; cluster/engine/kv_tiers
    # A draft checkpoint loaded only to build its KV of the prompts this engine sends, for requests
    # whose TransferTarget asks for it: a prefill worker beside decode workers drafting with it.
    prompt_draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", default_batched_tokens(self.device))
        positive = {
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise EngineConfigError(f"{name} must be a positive integer, got {quote(value)}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise EngineConfigError(
                f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}"
            )
        from cluster.engine.kernels.triton_support import BACKENDS
        from cluster.engine.models.loader import LOAD_FORMATS

        if self.attention_backend not in BACKENDS:
            raise EngineConfigError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise EngineConfigError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        from cluster.engine.quantization.choice import CHOICES as QUANTIZATIONS

        if self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quote(self.quantization)}"
            )
        from cluster.engine.quantization.kv_format import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {quote(self.kv_cache_dtype)}"
            )
        if self.cpu_matmul_dtype not in CPU_MATMUL_DTYPES:
            raise EngineConfigError(
                f"cpu_matmul_dtype must be one of {', '.join(CPU_MATMUL_DTYPES)}, got {quote(self.cpu_matmul_dtype)}"
            )
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise EngineConfigError(f"speculative must be a SpeculativeConfig or None, got {quote(self.speculative)}")
        if self.prompt_draft_model is not None:
            if not isinstance(self.prompt_draft_model, str) or not self.prompt_draft_model.strip():
                raise EngineConfigError(f"prompt_draft_model must name a draft checkpoint or be None, got "
                                        f"{quote(self.prompt_draft_model)}")
            if self.speculative is not None:
                raise EngineConfigError("prompt_draft_model is for an engine that only prefills (it sends its "
                                        "prompts' draft KV); a speculating engine loads its draft from "
                                        "speculative.draft_model: set one of them")
        from cluster.engine.kv_tiers.size import parse_host_cache

        try:
            parse_host_cache(self.host_cache)
        except ValueError as exc:
            raise EngineConfigError(f"host_cache {exc}") from None
        if self.host_cache is not None:
            if self.tensor_parallel_size != 1:
                raise EngineConfigError("host_cache needs tensor_parallel_size 1 (the host tier of a tensor-parallel "
                                        "engine is not built yet); set host_cache to null")
            if self.prompt_draft_model is not None or (self.speculative is not None
                                                       and self.speculative.method == "draft"):
                raise EngineConfigError("host_cache does not work with a draft model (its KV cache has no host tier); "
                                        "set host_cache to null or use speculative method ngram")
            if not self.enable_prefix_caching:
                raise EngineConfigError("host_cache keeps the prefix cache's evicted blocks: it needs "
                                        "enable_prefix_caching true")
        if not isinstance(self.enforce_eager, bool):
            raise EngineConfigError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        share = self.kv_memory_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or
                                  not 0.0 < share <= 1.0):
            raise EngineConfigError(f"kv_memory_share must be in (0, 1], got {quote(share)}")
        try:
            check_name("cluster", self.cluster_name)
            check_name("engine", self.engine_name)
        except GroupNameError as exc:
            raise EngineConfigError(str(exc)) from None

    def resolved_cpu_matmul_dtype(self) -> str:
        """This engine's CPU kernel's setting (``kernels.quantized_matmul.BF16_LAYOUTS`` says which
        weights each multiplies in bfloat16): float32 off the CPU (the GPU kernels have their own
        rules) and for ``auto`` where the kernel has no bfloat16 dot products; ``bfloat16`` refused
        there.

        Why ``auto`` takes 4-bit weights only: teacher-forced against transformers in float32,
        bfloat16 dot products keep the default model (Q4_1) at 99.07% top-1 agreement (99.27% with
        its q8 output layer in bfloat16 too) and +0.03% perplexity, and a random Q4_K at 100%, but a random Q8_0 at 96.5% (its 8-bit codes carry
        bits bfloat16's rounding reaches), under the 99% that float32 holds."""
        from cluster.engine.kernels.quantized_matmul import bf16_dots_supported

        if self.cpu_matmul_dtype == "float32" or not self.device.startswith("cpu"):
            return "float32"
        if bf16_dots_supported():
            return self.cpu_matmul_dtype
        if self.cpu_matmul_dtype == "auto":
            return "float32"
        raise EngineConfigError("cpu_matmul_dtype bfloat16 needs a CPU with AVX512_BF16 and the native kernels "
                                "(a C compiler); this machine lacks one: set cpu_matmul_dtype to auto or float32")

    @property
    def kv_share(self) -> float:
        """The part of the node's (or GPU's) KV budget each rank of this engine takes."""
        if self.kv_memory_share is not None:
            return float(self.kv_memory_share)
        return 1.0 if self.device.startswith("cuda") else 1.0 / self.tensor_parallel_size
