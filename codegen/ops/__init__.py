"""Each IR op's lowering for the compiled targets, declared once (``registry`` maps op names to
them): the kernels a node calls, by role, under a quantization plan; the Relax calls that run
them in an entry function; and which of the node's inputs are matmul weights, with how the
artifact stores those. One module per family of ops that share code; ``base`` holds what they
are made of and imports no TVM, so ``lowering`` stays light to import.
"""
