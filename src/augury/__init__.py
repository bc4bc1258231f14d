"""augury: an LLM inference server with load-aware EAGLE-3 speculative decoding."""
# `import augury` sets nothing process-wide (no environment variable, no global torch state): a host
# application and any peer in its process (llama.cpp, another torch model) keep their own defaults.
# OpenMP threads wait libgomp's default way, a bounded spin and then sleep (docs/architecture.md).
from augury.outputs import RequestOutput, SpecStats
from augury.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it lazily so `import augury` stays cheap.
    if name == "LLM":
        from augury.llm import LLM

        return LLM
    raise AttributeError(f"module 'augury' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpecStats", "__version__"]
