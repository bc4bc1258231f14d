"""Speculative decoding: draft proposal, draft trees, lossless verification, speculation policy."""
