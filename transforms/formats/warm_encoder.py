"""Imported ahead by the warm worker pool (:mod:`refinery.runners.warm_workers`) of prep and
prep-mixture: builds the fast encoder of the default tokenizer (o200k) in the warm process, so
that every worker forked from it has it already instead of building its own (reading the vocab
file, ~0.2 s of CPU, and importing awkward at its first batch, ~0.2 s), and shares its pages.

Building it starts no thread, and its batches never use gigatoken's thread pool, so a fork
after it is safe (tests/test_fast_encoder.py). Where it cannot be built, nothing is and nothing
is printed: each worker then builds its own, and says why when it cannot.
"""
from refinery.transforms.formats.gigatoken_encoder import preload

preload()
