"""The tiny random Ouro model the engine-level tests share (fp32, rounds that differ)."""
from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM

ROUNDS = 4


def tiny_engine_model(seed: int = 0) -> OuroForCausalLM:
    cfg = OuroConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, total_ut_steps=ROUNDS,
                     max_position_embeddings=256)
    return OuroForCausalLM(cfg).init_weights(seed, std=0.2).eval()
