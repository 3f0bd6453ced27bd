"""The LoRA scenario's adapter: a PEFT folder for the e2e's model (SmolLM2-135M: hidden 576, 30 layers, q_proj
576 -> 576, v_proj 576 -> 192), rank 8 on q_proj and v_proj, random weights, written by the tests' own
writer (tests/support/lora_adapters.py).

Run as a child (`python e2e/lora_adapter.py FOLDER`): the writer needs torch, which the e2e's own process
does not import. The writer reads only the linear layers' names and shapes, so a skeleton of them on the
meta device stands in for the model.
"""

from __future__ import annotations

import sys
from pathlib import Path

HIDDEN, LAYERS, Q_OUT, V_OUT = 576, 30, 576, 192
RANK = 8
BASE = "HuggingFaceTB/SmolLM2-135M"


def skeleton():  # noqa: ANN201 - a torch module; torch is imported here only
    import torch

    def module(**children: torch.nn.Module) -> torch.nn.Module:
        m = torch.nn.Module()
        for name, child in children.items():
            m.add_module(name, child)
        return m

    def layer() -> torch.nn.Module:
        return module(self_attn=module(q_proj=torch.nn.Linear(HIDDEN, Q_OUT, bias=False, device="meta"),
                                       v_proj=torch.nn.Linear(HIDDEN, V_OUT, bias=False, device="meta")))

    return module(model=module(layers=torch.nn.ModuleList(layer() for _ in range(LAYERS))))


def main(folder: str) -> None:
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from support.lora_adapters import write_adapter

    write_adapter(Path(folder), skeleton(), rank=RANK, targets=("q_proj", "v_proj"), seed=38,
                  extra_config={"base_model_name_or_path": BASE})


if __name__ == "__main__":
    main(sys.argv[1])
