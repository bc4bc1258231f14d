"""What the engine and speculation both build on, and neither owns: a request's state
(request.py), the paged KV cache's blocks and prefix keys (kv_cache.py), timers that wait for the
device (timing.py) and the engine-wide step statistics (stats.py). Imports nothing above it."""
