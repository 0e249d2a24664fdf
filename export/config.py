"""Options of ``layercut export`` (a recipe's ``export`` stage), beside the export code they drive.
Torch-free."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from layercut.compress.core.units import check_size
from layercut.compress.options import Dtype, SaveDtype, StageConfig


class ExportConfig(StageConfig):
    """Options of ``layercut export`` and of a recipe's ``export`` stage."""

    help: ClassVar[str] = "write a release checkpoint (safetensors + index, model card); dequantize GPTQ"
    examples: ClassVar[tuple[str, ...]] = (
        "layercut export runs/demo -o release",
        "layercut export runs/demo/03-quantize/model -o dense --dequantize --save-dtype bf16",
        "layercut export dense/ -o gguf --format gguf --gguf-type q8_0",
        "layercut export runs/demo/03-quantize/model -o ct --format compressed-tensors",
    )

    stage: Literal["export"] = "export"
    format: Literal["safetensors", "gguf", "compressed-tensors"] = Field(
        "safetensors", description="safetensors (transformers), gguf (llama.cpp; dense models) or "
                                   "compressed-tensors (vLLM; GPTQ models)")
    gguf_type: Literal["f16", "bf16", "q8_0"] | None = Field(
        None, description="tensor type of the GGUF matrices (with --format gguf; none: f16)")
    dequantize: bool = Field(False, description="turn a GPTQ checkpoint back into dense weights")
    dtype: Dtype = Field("auto", description="dtype a dense model is read in (auto: the checkpoint's own)")
    save_dtype: SaveDtype | None = Field(None, description="dtype of the written dense weights (none: as loaded)")
    max_shard_size: str = Field("2GB", description="largest safetensors file, e.g. 500MB or 2GB")
    card: bool = Field(True, description="write a README.md model card")
    whole_model: bool = Field(False, description="load the whole model instead of copying a dense checkpoint "
                                                 "(or dequantizing a GPTQ one) tensor by tensor")

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        return check_size(v)
