"""`python -m rltlab.pretrain`: the same as `rltlab pretrain`."""
import argparse

from rltlab.pretrain.recipe import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m rltlab.pretrain",
                                 description="train the embedded model")
add_arguments(parser)
raise SystemExit(main(parser.parse_args()))
