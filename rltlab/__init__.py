"""rltlab: a research workbench for looped language models."""
__version__ = "0.1.0"
