"""The tiny random Ouro models the tests share: an engine-level model (fp32, rounds that differ)
and a tiny checkpoint directory with a tokenizer (notebooks, run directories)."""
import torch

from rltlab.model.config import OuroConfig
from rltlab.model.architecture import OuroForCausalLM

ROUNDS = 4


def tiny_engine_model(seed: int = 0) -> OuroForCausalLM:
    cfg = OuroConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, total_ut_steps=ROUNDS,
                     max_position_embeddings=256)
    return OuroForCausalLM(cfg).init_weights(seed, std=0.2).eval()


def with_distinct_norms(model: OuroForCausalLM, seed: int = 0) -> OuroForCausalLM:
    """model with every RMSNorm weight drawn around 1 (init_weights leaves them all 1, so a
    kernel that swapped two norms' weights would go unnoticed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
    return model


def write_tiny_checkpoint(out):
    """A tiny random model directory (config, bf16 weights, a trained 300-token tokenizer) at
    `out`, the shape the notebook and run-directory tests use."""
    from rltlab.model.checkpoint import save_pretrained
    from rltlab.pretrain.data import save_tokenizer, train_tokenizer

    tok = train_tokenizer(vocab_size=300, max_bytes=150_000)
    cfg = OuroConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     total_ut_steps=4, max_position_embeddings=1024, bos_token_id=0,
                     eos_token_id=0)
    save_pretrained(OuroForCausalLM(cfg).init_weights(0, std=0.1), out)
    save_tokenizer(tok, out)
    return out


def random_prompts(n: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    """n prompts of tiny_engine_model's vocabulary (ids 1..60), lengths drawn in
    [min_len, max_len) (lengths differ: padding and ragged batches get exercised)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 61, (int(k),), generator=gen).tolist()
            for k in torch.randint(min_len, max_len, (n,), generator=gen)]

