"""A model folder's tokenizer, as ``AutoTokenizer.from_pretrained`` would make it, for the daemon's engine
and the router alike.

``AutoTokenizer`` spends 0.7 s of a 2-core start on auto-class tables to find the class that
tokenizer_config.json already names, so ``load_tokenizer`` loads the tokenizers-backed class directly
when tokenizer_config.json names it and a tokenizer.json is there; otherwise ``AutoTokenizer``
(tests/test_model_files.py compares them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_tokenizer"]

# tokenizer classes that are the tokenizers-backed base class itself (transformers 5 and 4 names)
_PLAIN_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(path: Path) -> Any:
    """The folder's tokenizer, as ``AutoTokenizer.from_pretrained`` would make it."""
    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_config = {}
    if (
        isinstance(tok_config, dict)
        and tok_config.get("tokenizer_class") in _PLAIN_TOKENIZER_CLASSES
        and not tok_config.get("auto_map")
        and (path / "tokenizer.json").is_file()
    ):
        from transformers import PreTrainedTokenizerFast  # the tokenizers backend class itself

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
