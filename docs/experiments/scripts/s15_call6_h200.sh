#!/bin/bash
# For the fifteenth session's sixth device call (H200): s15_call4's commands again, now that
# EngineConfig.compile also torch.compile's the tree program's glue around the rounds (the
# indices, block copies, acceptance walk, commit and heads: tree_graph._Program._prepare /
# _conclude).
exec bash "$(dirname "$0")/s15_call4_h200.sh"
