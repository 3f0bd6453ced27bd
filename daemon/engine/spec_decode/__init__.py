"""Speculative decoding: drafts (n-gram lookup or a draft model) verified by the target in one forward pass.

Only the config imports here at once (EngineConfig checks it); the engine imports the rest when a
speculative_config is set.
"""

from .config import METHODS, SpeculativeConfig, parse_speculative_config

__all__ = ["METHODS", "SpeculativeConfig", "parse_speculative_config"]
