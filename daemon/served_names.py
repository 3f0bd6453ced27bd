"""Which names a client may put in `model`, and which one the server reports.

With --served-model-name the given names are served, the first one reported (as in vLLM). Without
it a built-in model is served under its short name (`smollm2-135m`), and its URI and family name
(`smollm2`, the name the README and the example CR use) are accepted too; any other model is served
under the name the engine loaded it as.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BUILTIN_SCHEME = "builtin://"
# built-in model -> extra names it answers to
BUILTIN_ALIASES: dict[str, tuple[str, ...]] = {"smollm2-135m": ("smollm2",)}


@dataclass(frozen=True)
class ServedNames:
    listed: tuple[str, ...]  # what /v1/models shows; the first is the primary name
    aliases: tuple[str, ...] = ()  # accepted in `model`, never listed

    @property
    def primary(self) -> str:
        return self.listed[0]

    @property
    def accepted(self) -> tuple[str, ...]:
        return self.listed + self.aliases

    def accepts(self, name: str) -> bool:
        return name in self.accepted


def served_names(model: str, served_model_name: Sequence[str] = ()) -> ServedNames:
    """The names for `model` (a URI or the engine's model name) unless names were given explicitly."""
    if served_model_name:
        return ServedNames(tuple(dict.fromkeys(served_model_name)))
    if model.startswith(BUILTIN_SCHEME):
        short = model[len(BUILTIN_SCHEME):]
        aliases = (model, *BUILTIN_ALIASES.get(short, ()))
        return ServedNames((short,), tuple(a for a in aliases if a != short))
    return ServedNames((model,))
