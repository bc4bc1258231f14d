"""The serving engine: requests, paged KV cache, scheduler, sampler and the step loop."""
