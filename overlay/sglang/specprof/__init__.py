"""sglang-specprof: phase-by-phase timing of EAGLE / EAGLE3 speculative decoding.

The analysis modules (window, stats, schema) are plain Python and import neither
torch nor the rest of SGLang, so profiles can be read anywhere.
"""

__all__ = ["SCHEMA_VERSION"]

SCHEMA_VERSION = 1
