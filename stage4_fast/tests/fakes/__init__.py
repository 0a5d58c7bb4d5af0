"""Same-interface PyTorch stand-ins for the GPU attention libraries, so the backends' metadata logic runs on CPU.

They take the arguments the real libraries take (names, dtypes, layouts), check what the real ones check, and
compute the attention the way the library defines it. The CUDA-graph wrapper keeps the real contract: ``plan``
writes into the fixed buffers given at construction and ``run`` reads only those buffers.
"""
