"""Loop-aware draft components (heads on the frozen round-d state, draft-only LoRAs), their
distillation and evaluation: see docs/experiments/loop_speculation.md."""
from rltlab.draft_heads.heads import (LayerLoraDrafter, LoraLMHead, ResidualMLPHead,  # noqa: F401
                                      build_component, component_kwargs, save_component)
