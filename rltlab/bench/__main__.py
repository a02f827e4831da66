"""python -m rltlab.bench: the engine against the model's plain cached loop (bench/throughput.py)."""
from rltlab.bench.throughput import main
from rltlab.common.command import run_command

if __name__ == "__main__":
    run_command(main)
