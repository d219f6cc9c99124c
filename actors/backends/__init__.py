"""Device backends behind one narrow seam: memory, kernel binding, copies.

``aten``: kernels recorded by the aten capture, on any torch device."""
