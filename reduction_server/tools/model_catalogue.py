"""A few common models' gradients, for `size --simulate --model NAME`: parameter counts as their
papers give them (one gradient element per parameter)."""

from __future__ import annotations

from typing import Dict, NamedTuple

from ..errors import ConfigError


class Model(NamedTuple):
    name: str
    parameters: float
    source: str


MODELS: Dict[str, Model] = {
    m.name: m
    for m in (
        Model("resnet50", 25.6e6, "ResNet-50 (He et al. 2016; torchvision: 25,557,032)"),
        Model("bert-large", 336e6, "BERT-large, 24 layers, hidden 1024 (Devlin et al. 2019)"),
        Model("7b", 6.74e9, "a 7B transformer: LLaMA-7B, 32 layers, hidden 4096 (Touvron et al. 2023)"),
        Model("70b", 69.0e9, "a 70B transformer: Llama 2 70B, 80 layers, hidden 8192 (Touvron et al. 2023)"),
    )
}


def model(name: str) -> Model:
    """The model called `name` (case and '-'/'_' ignored); an unknown one is refused naming the known."""
    key = name.strip().lower().replace("_", "-")
    found = MODELS.get(key) or MODELS.get(key.replace("-", ""))
    if found is None:
        raise ConfigError(f"unknown --model {name!r}; choose from {', '.join(MODELS)}")
    return found
