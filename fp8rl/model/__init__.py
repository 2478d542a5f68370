"""Models: config, the decoder, loading (HF folders, GGUF, built-ins), tokenizer, export."""

from .config import ModelConfig
from .export import export_fp8_block, export_hf
from .load import load
from .tokenizer import Tokenizer
from .transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "Tokenizer", "load", "export_hf", "export_fp8_block"]
