"""What the engine's forward runs on: the cache a tree is verified against and how the model is called.

Two bases serve the one step loop (`forerun.engine.decode`), behind the `TreeBase` protocol:

- `DynamicBase`: a growing transformers `DynamicCache`, trees fed at their own size, the output matrix in the
  layout this CPU computes fastest (`forerun.head`), the prefix cache. The CPU's base.
- `StaticBase`: a preallocated cache written at explicit slots, trees padded to a few sizes (buckets), each
  bucket's forward captured once as a CUDA graph on a GPU, the target's greedy choice at every node computed on
  the device and copied to the host once per step. The GPU's base.
"""

from forerun.base.dynamic import DynamicBase, TreeBase, TreeLogits
from forerun.base.static import BUCKETS, StaticBase, graph_features, static_support

__all__ = ["BUCKETS", "DynamicBase", "StaticBase", "TreeBase", "TreeLogits", "graph_features", "static_support"]
