"""What the engine's forward runs on: the cache a tree is verified against and how the model is called.

Two bases serve the one step loop (`forerun.engine.decode`), behind the `TreeBase` protocol:

- `DynamicBase` (`forerun.base.dynamic`): a growing cache that keeps its room, trees fed at their own size, the
  output matrix in the layout this CPU computes fastest (`forerun.head`), the prefix cache. The CPU's base.
- `StaticBase` (`forerun.base.static`): a preallocated cache written at explicit slots, trees padded to a few sizes
  (buckets), each bucket's forward captured once as a CUDA graph on a GPU, the target's greedy choice at every node
  computed on the device and copied to the host once per step. The GPU's base.

The package imports neither (its modules import each other's helpers: kernels, weights, packed layouts).
"""
