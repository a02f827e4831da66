"""Pretraining of the embedded default model: the data (data), the Stage I + Stage II recipe
(recipe, `rltlab pretrain` / `python -m rltlab.pretrain`), per-round evaluation (evaluate) and
the `rltlab rounds` report (rounds)."""
