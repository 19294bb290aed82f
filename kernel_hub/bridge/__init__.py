"""The torch bridge: a JAX function becomes a torch custom op (fake, autograd, compile), run on
the tensors' device through one runtime per torch device type (``runtimes/``)."""
