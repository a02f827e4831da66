"""The model: the Ouro architecture (architecture), its config (config), the exit-gate math
(gates), checkpoint I/O (checkpoint) and the plain generation loop (generate).

    from rltlab.model import OuroForCausalLM, OuroConfig, load_model_and_tokenizer
"""
from rltlab.model.architecture import LoopedOutput, OuroForCausalLM
from rltlab.model.checkpoint import (from_pretrained, load_model, load_model_and_tokenizer,
                                     load_tokenizer, model_hash, save_pretrained)
from rltlab.model.config import OuroConfig
from rltlab.model.generate import generate_plain

__all__ = ["LoopedOutput", "OuroConfig", "OuroForCausalLM", "from_pretrained", "generate_plain",
           "load_model", "load_model_and_tokenizer", "load_tokenizer", "model_hash",
           "save_pretrained"]
