"""Speculative decoding inside the engine: the proposers `LLMEngine.set_proposer` takes, the
decoder that runs them (decoder.py), the device programs of the built-in proposers
(draft_program.py, tree_graph.py, tree_program.py) and prompt lookup (prompt_lookup.py)."""
from rltlab.engine.spec.proposers import LOOKUP_RULES, DraftProposer, TreeProposer, validate_tree

__all__ = ["LOOKUP_RULES", "DraftProposer", "TreeProposer", "validate_tree"]
