"""augury: an LLM inference server with load-aware EAGLE-3 speculative decoding."""
import os

# torch's CPU threads meet at an OpenMP barrier after every operator; by default a waiting thread
# spins, and on a shared machine a spinning thread whose partner was descheduled burns the core the
# partner needs. Measured on 2 cores, demo decoding, time at 2 threads over 1 thread: idle 0.81
# spinning, 0.91 passive; with one core busy elsewhere 2.89 spinning (12.3 with GOMP_SPINCOUNT=1e5),
# 1.09 passive. So augury waits passively unless the environment says otherwise. OpenMP reads this
# when torch loads: it must be set before torch is imported (augury imports torch only lazily).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
