"""Speculative decoding inside the engine: the proposers `LLMEngine.set_proposer` takes (the
built-in DraftProposer and TreeProposer, proposers.py, or any object of the Proposer protocol,
protocol.py), the decoder that runs them (decoder.py), the generic tree verifier any proposer's
drafts go through (tree_verify.py, tree_sampling.py; a TreeProposer's as tree_drafts.py makes
them), the device programs of the built-in proposers (draft_program.py, tree_graph.py,
tree_program.py) and prompt lookup (prompt_lookup.py)."""
from rltlab.engine.spec.proposers import LOOKUP_RULES, DraftProposer, TreeProposer, validate_tree
from rltlab.engine.spec.protocol import DraftState, DraftTree, Proposer, Verdict
from rltlab.engine.spec.decoder import SpeculationOffWarning

__all__ = ["LOOKUP_RULES", "DraftProposer", "DraftState", "DraftTree", "Proposer",
           "SpeculationOffWarning", "TreeProposer", "Verdict", "validate_tree"]
