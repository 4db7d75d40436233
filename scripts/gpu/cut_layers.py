"""A model config cut to fewer layers: cut_layers.py CONFIG N OUT writes CONFIG with
num_hidden_layers N to OUT (the few-layer checkpoints of the GPU scripts)."""
import json
import sys

cfg, layers, out = sys.argv[1:4]
c = json.load(open(cfg))
c["num_hidden_layers"] = int(layers)
json.dump(c, open(out, "w"))
