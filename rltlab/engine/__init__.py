"""The rollout engine for looped (Ouro) language models. See docs/engine.md."""
from rltlab.engine.async_engine import AsyncLLM, EngineShutdown
from rltlab.engine.block_manager import CapacityError
from rltlab.engine.config import EngineConfig, ExecutionConfig
from rltlab.engine.exit_policies import (ExitPolicy, RoundInfo, available_exit_policies,
                                         create_exit_policy, register_exit_policy)
from rltlab.engine.hooks import RoundEvent
from rltlab.engine.spec.proposers import DraftProposer, TreeProposer
from rltlab.engine.llm import LLM
from rltlab.engine.llm_engine import LLMEngine
from rltlab.engine.outputs import CompletionOutput, RequestOutput, raise_on_errors
from rltlab.engine.sampling import SamplingParams
from rltlab.engine.weights import WeightUpdateError

__all__ = [
    "AsyncLLM", "CapacityError", "CompletionOutput", "DraftProposer", "EngineConfig",
    "EngineShutdown", "ExecutionConfig", "ExitPolicy", "LLM", "LLMEngine", "RequestOutput",
    "RoundEvent", "RoundInfo", "SamplingParams", "TreeProposer", "WeightUpdateError",
    "available_exit_policies", "create_exit_policy", "raise_on_errors", "register_exit_policy",
]
